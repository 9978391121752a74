local record, index = KEYS[1], KEYS[2]
local held = redis.call('HMGET', record, 'status', 'fencing_token', 'expires_at', 'created_at')
if held[1] ~= 'in_progress' or held[2] ~= ARGV[7] then
    return 0
end
