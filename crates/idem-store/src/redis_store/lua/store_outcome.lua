local retention = tonumber(held[3]) - tonumber(held[4])
local expires_at = string.format('%d', now + retention)
redis.call('HSET', record, 'status', 'completed', 'response_code', ARGV[1],
    'response_headers', ARGV[2], 'response_body', ARGV[3], 'body_omitted', ARGV[4],
    'expires_at', expires_at)
redis.call('ZADD', index, expires_at, record)
local ttl = math.max(1, math.min(retention + tonumber(ARGV[5]), tonumber(ARGV[6])))
redis.call('PEXPIRE', record, string.format('%d', ttl))
return 1
