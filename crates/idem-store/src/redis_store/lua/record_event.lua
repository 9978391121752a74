-- Adds an event to a key's history (AdminStore::record_event): an operator's or a reconciler's
-- act, never a request's. The list keeps the key's latest ARGV[2] events and expires ARGV[3] ms
-- after its latest one, so no history grows without bound.
--
-- KEYS: the key's event list (with its record's hash tag on a cluster). ARGV: the event (JSON:
-- at, what, by), how many to keep, how long to keep the list (ms).
local events = KEYS[1]
redis.call('RPUSH', events, ARGV[1])
redis.call('LTRIM', events, -tonumber(ARGV[2]), -1)
redis.call('PEXPIRE', events, ARGV[3])
return 1
