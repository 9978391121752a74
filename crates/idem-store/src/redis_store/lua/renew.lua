local record = KEYS[1]
local held = redis.call('HMGET', record, 'status', 'fencing_token')
if held[1] ~= 'in_progress' or held[2] ~= ARGV[1] then
    return 0
end
redis.call('HSET', record, 'lease_until', string.format('%d', now + tonumber(ARGV[2])))
return 1
