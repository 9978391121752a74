local state, stale = ARGV[1], ARGV[2]
local found = {}
for i, record in ipairs(KEYS) do
    local held = redis.call('HMGET', record, 'status', 'lease_until')
    local status = held[1]
    if status and (state == '' or status == state) and (stale == ''
            or (status == 'in_progress' and tonumber(held[2]) <= now + tonumber(stale))) then
        found[#found + 1] = i
        found[#found + 1] = redis.call('HGETALL', record)
    end
end
return {now, found}
