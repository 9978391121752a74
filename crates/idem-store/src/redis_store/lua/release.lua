local record, index = KEYS[1], KEYS[2]
local held = redis.call('HMGET', record, 'status', 'fencing_token')
if held[1] ~= 'in_progress' or held[2] ~= ARGV[1] then
    return 0
end
redis.call('DEL', record)
redis.call('ZREM', index, record)
return 1
