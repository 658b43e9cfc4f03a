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

# KEYS: job, events, live. ARGV: ttl, job id, keys.cancels(""), "1" to delete the job, keys.waiting(""), then the
# events that close a queued job's log, numbered from 1, `done` last.
# A queued job is cancelled here and its log closed. A running one is named in its worker's cancel set, which that
# worker reads with every step's writes, so it stops at the step after; the worker takes it out when the job ends.
# The names of the waiting set and the cancel set are completed here from the record (its model, its holding
# worker), so the script names keys it was not given: fine on one Redis server, not on a Redis Cluster.
# A log that cannot take these entries (its key holds another type) does not stop the cancel: the events are still
# published, as PUBLISH_EVENTS does, and readers of the log learn they are lost.
# Deleted, a job is gone for readers at once. A running one's record and log stay, hidden, until its worker's last
# write removes them (or they expire, should that write never come): until then its id is taken, so a job submitted
# again under it cannot meet the old run's writes in its own log. Returns the status, nil for no such job.
CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return nil end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled')
  local model = redis.call('HGET', KEYS[1], 'model')
  if model then redis.call('ZREM', ARGV[5] .. model, ARGV[2]) end
  for i = 6, #ARGV do
    redis.pcall('XADD', KEYS[2], '0-' .. (i - 5), 'msg', ARGV[i])
    redis.call('PUBLISH', KEYS[3], ARGV[i])
  end
  for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
elseif status == 'in_progress' then
  local worker = redis.call('HGET', KEYS[1], 'worker')
  if not worker then return redis.error_reply('ERR running job ' .. ARGV[2] .. ' names no worker') end
  redis.call('SADD', ARGV[3] .. worker, ARGV[2])
  redis.call('EXPIRE', ARGV[3] .. worker, ARGV[1])
end
if ARGV[4] == '1' then
  if status == 'in_progress' then
    redis.call('HSET', KEYS[1], 'deleted', '1')
    for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
  else
    redis.call('DEL', KEYS[1], KEYS[2])
  end
end
return status
"""

# One call per engine step for every event of every job: KEYS come in threes (a job's record, its event log, its live
# channel), ARGV in pairs (the entry id 0-<seq>, the message). Each event is appended to the log, then published. An
# event already in the log (its id is not above the log's last) is skipped, so a step sent again after a lost reply is
# written and published once. So is every event of a job whose record is gone: while a job runs its record exists
# (hidden, if DELETE came), so a missing one means the job's last write, which removes a deleted job's record and
# log, already landed, and this is that step sent again: written, it would bring back a log that a job submitted
# again under the same id would meet. A log that can never take an entry (its key holds another type) costs its job
# the replay, not the other jobs their events: the event is still published (again each time the step is sent
# again: readers drop what they already have by its number), and the key is returned. Any other refusal (out of
# memory, a read-only replica) stops the step, which the worker sends again.
PUBLISH_EVENTS = """
local refused, exists = {}, {}
for k = 1, #ARGV / 2 do
  local job, i = KEYS[3 * k - 2], 2 * k - 1
  if exists[job] == nil then exists[job] = redis.call('EXISTS', job) == 1 end
  if exists[job] then
    local log, live = KEYS[3 * k - 1], KEYS[3 * k]
    local added = redis.pcall('XADD', log, ARGV[i], 'msg', ARGV[i + 1])
    local err = type(added) == 'table' and added.err
    if err then
      -- Redis 6 words a refusal raised inside a script "@user_script: 4: -READONLY ...": keep "READONLY ...", whose
      -- first word is what clients read the kind of error from.
      err = err:gsub('^@[^:]*:%s*%d+:%s*', ''):gsub('^%-', ''):gsub('%s+$', '')
    end
    if not err then
      redis.call('PUBLISH', live, ARGV[i + 1])
    elseif string.sub(err, 1, 9) == 'WRONGTYPE' then
      refused[#refused + 1] = log
      redis.call('PUBLISH', live, ARGV[i + 1])
    elseif not string.find(err, 'equal or smaller', 1, true) then
      return redis.error_reply(err)
    end
  end
end
return refused
"""

# KEYS: job, events. ARGV: ttl in seconds, "1" for the job's last write ("0": progress), then field/value pairs. How a
# worker writes a job's record. The log's expiry is refreshed first, whatever became of the record, so the log of a job
# whose worker vanished still expires. A record deleted meanwhile (DELETE of a running job) is not written: a record
# gone stays gone, instead of coming back holding only the fields written here, which no reader could make a job of;
# one hidden by DELETE is removed with the job's log at the last write. The last write also starts the record's expiry.
UPDATE_RECORD = """
redis.call('EXPIRE', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then
  if ARGV[2] == '1' then redis.call('DEL', KEYS[1], KEYS[2]) end
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
if ARGV[2] == '1' then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 1
"""
