"""Atomic job-record transitions, as Lua scripts both sides run.

A record is created queued by the API's submit; the status field then changes hands exactly once per transition:
queued -> in_progress by one worker's claim, queued -> cancelled by the API, in_progress -> completed | failed |
cancelled by the worker that holds it.
"""

from __future__ import annotations

# KEYS: job, waiting zset, Celery queue list. ARGV: job id, queue score, Celery task message, then the record's
# field/value pairs. Records the job and enqueues its task in one step, so no job exists that no worker will get.
# Returns the job's rank in the waiting set (its queue position - 1), or nil when the id is taken: a repeated
# request_id never overwrites a job.
SUBMIT = """
if redis.call('HSETNX', KEYS[1], 'id', ARGV[1]) == 0 then return nil end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[3])
return redis.call('ZRANK', KEYS[2], ARGV[1])
"""

# KEYS: job, waiting zset, the claiming worker's cancel set. ARGV: worker name, now, job id. Returns the claimed
# record (HGETALL's field/value list), empty when the job is not this worker's to run: the claim and the read are one
# round trip. A cancel recorded for this id before this claim was for an earlier job of the same id (deleted, then
# submitted again with the same request_id): it must not stop this one.
CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return {} end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'worker', ARGV[1], 'started', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('SREM', KEYS[3], ARGV[3])
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: job, events, live, waiting zset. ARGV: ttl, done message, job id, keys.cancels("").
# A queued job is cancelled here and its log closed. A running one is named in its worker's cancel set, which that
# worker reads with every step's writes, so it stops at the step after; the worker takes it out when the job ends.
# The set's name is completed here from the record (the holding worker is only known once read), so the script names
# a key it was not given: fine on one Redis server, not on a Redis Cluster.
CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return nil end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled')
  redis.call('ZREM', KEYS[4], ARGV[3])
  redis.call('XADD', KEYS[2], '0-1', 'msg', ARGV[2])
  redis.call('PUBLISH', KEYS[3], ARGV[2])
  for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
elseif status == 'in_progress' then
  local worker = redis.call('HGET', KEYS[1], 'worker')
  if not worker then return redis.error_reply('ERR running job ' .. ARGV[3] .. ' names no worker') end
  redis.call('SADD', ARGV[4] .. worker, ARGV[3])
  redis.call('EXPIRE', ARGV[4] .. worker, ARGV[1])
end
return status
"""

# One call per engine step for every event of every job: KEYS come in pairs (a job's event log, its live channel),
# ARGV in pairs (the entry id 0-<seq>, the message). Each event is appended to the log, then published. An event
# already in the log (its id is not above the log's last) is skipped, so a step sent again after a lost reply is
# written and published once. A log that can never take an entry (its key holds another type) costs its job the
# replay, not the other jobs their events: the event is still published, and the key is returned. Any other
# refusal (out of memory, a read-only replica) stops the step, which the worker sends again.
PUBLISH_EVENTS = """
local refused = {}
for i = 1, #KEYS, 2 do
  local added = redis.pcall('XADD', KEYS[i], ARGV[i], 'msg', ARGV[i + 1])
  local err = type(added) == 'table' and added.err
  if not err then
    redis.call('PUBLISH', KEYS[i + 1], ARGV[i + 1])
  elseif string.sub(err, 1, 9) == 'WRONGTYPE' then
    refused[#refused + 1] = KEYS[i]
    redis.call('PUBLISH', KEYS[i + 1], ARGV[i + 1])
  elseif not string.find(err, 'equal or smaller', 1, true) then
    return redis.error_reply(err)
  end
end
return refused
"""

# KEYS: job. ARGV: ttl in seconds (0: keep the record's expiry), then field/value pairs. How a worker writes a job's
# record: one deleted meanwhile (DELETE of a running job) stays deleted, instead of coming back holding only the
# fields written here, which no reader could make a job of.
UPDATE_RECORD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
if ARGV[1] ~= '0' then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 1
"""
