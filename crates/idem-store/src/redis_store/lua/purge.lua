redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('DEL', KEYS[3])
return redis.call('DEL', KEYS[1])
