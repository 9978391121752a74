return {now, redis.call('HGETALL', KEYS[1])}
