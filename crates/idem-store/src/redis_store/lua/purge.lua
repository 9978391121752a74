redis.call('ZREM', KEYS[2], KEYS[1])
return redis.call('DEL', KEYS[1])
