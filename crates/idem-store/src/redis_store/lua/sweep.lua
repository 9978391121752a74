local index = KEYS[1]
local deleted = 0
local due = redis.call('ZRANGEBYSCORE', index, '-inf', string.format('%d', now),
    'LIMIT', 0, ARGV[1])
for _, record in ipairs(due) do
    local held = redis.call('HMGET', record, 'status', 'expires_at')
    local status = held[1]
    if not status then
        redis.call('ZREM', index, record)
    elseif status == 'completed' and tonumber(held[2]) <= now then
        redis.call('DEL', record)
        redis.call('ZREM', index, record)
        deleted = deleted + 1
    elseif status == 'completed' then
        redis.call('ZADD', index, held[2], record)
    else
        redis.call('ZADD', index, '+inf', record)
    end
end
return deleted
