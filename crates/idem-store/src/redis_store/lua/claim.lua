local record, index = KEYS[1], KEYS[2]
local held = redis.call('HMGET', record, 'status', 'expires_at', 'lease_until', 'request_hash')
local status = held[1]
if status then
    local expired = status == 'completed' and tonumber(held[2]) <= now
    local take_over = ARGV[5] == '1' and status == 'in_progress'
        and tonumber(held[3]) <= now and held[4] == ARGV[1]
    if not (expired or take_over) then
        return {now, redis.call('HGETALL', record)}
    end
    redis.call('DEL', record)
end
redis.call('HSET', record,
    'request_hash', ARGV[1], 'status', 'in_progress', 'created_at', string.format('%d', now),
    'expires_at', string.format('%d', now + tonumber(ARGV[3])),
    'lease_until', string.format('%d', now + tonumber(ARGV[2])), 'fencing_token', ARGV[4])
redis.call('ZADD', index, '+inf', record)
if ARGV[6] ~= '' then
    redis.call('ZREMRANGEBYSCORE', index, '-inf',
        '(' .. string.format('%d', now - tonumber(ARGV[6])))
end
return 1
