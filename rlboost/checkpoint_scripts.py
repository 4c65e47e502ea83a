"""The checkpoint store's Lua scripts: every fenced write (claim, append, finish, renew, release,
an episode's environment step and state, vouch) and the trainer's reset, as Redis runs them.

A data module: `rlboost.checkpoint.CheckpointStore` registers these strings and sends them by
EVALSHA; what each answers is decided here, what the answer means is rlboost.errors.LUA_CODES.
Kept apart so that the store's Python reads on its own and a script's long explanation sits
next to the script. The names are also importable from rlboost.checkpoint (tests read and
patch them there: the store registers whatever `rlboost.checkpoint` holds when it is built).
"""

# Every script answers with the codes of rlboost.errors.LUA_CODES (-1 stale epoch, -2 offset
# mismatch, -3 finished, -4 Redis refused a command, -5 lease held): one meaning per code.
#
# A write under a lease needs the claimant's secret (`CheckpointStore.secret`, the last ARGV of
# every script): the claim keeps only its digest, in the meta hash (`key`), and each write
# compares the digest of the secret it is given with it. The epoch alone is no proof: any
# credential can read it (HGET). A writer without the secret is answered -1 like a stale epoch:
# either way it does not hold the lease. SHA-1 is enough here: what an attacker would need is a
# preimage of a digest of 128 random bits, and SHA-1 has no practical preimage attack (only
# collisions, which do not help: the secret is not the attacker's choice); it is what Redis Lua
# offers (`redis.sha1hex`).
#
# The scripts an environment worker runs (claim with `inherit`, append_env, episode, renew,
# release, finish) call neither EXPIRE nor PEXPIRE, so the env role holds neither command
# (rlboost/auth.py) and cannot shorten the life of a finished checkpoint with them: a lease is
# renewed by SET ... PX, a released or finished lease is ended by SET ... PX 1 (gone a millisecond
# later, as if deleted: the role has no DEL either), and a token key is created with its TTL by
# SET ... EX.
_CLAIM = """
redis.replicate_commands()  -- TIME is not deterministic: replicate the effects (Redis < 7)
local meta, lease, hist, tok = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, ttl, version, steal, keep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
local weights = ARGV[6]
local inherit = ARGV[7] == '1'
local digest = redis.sha1hex(ARGV[8])
if inherit then  -- an environment worker's claim: it generates nothing, the labels stay the last segment's
  local last = redis.call('LRANGE', hist, -1, -1)[1]
  if last then
    local lv, lw = string.match(last, '^%S+ %S+ %d+ (%S+) ?(%S*)')
    if lv then version, weights = lv, lw end
  end
end
local ep = KEYS[5]  -- an episode's state key: only an episode's claim names it (and gets its state)
local m = redis.call('HMGET', meta, 'finished', 'epoch', 'released', 'spec')
-- The request's spec (`wire.spec_digest`): a claim from the fresh lane (only the trainer publishes
-- there) records it; a hand-off (resume or environment lane: any worker credential publishes
-- there) is taken only for a request recorded so, with that spec. Checked before `finished`: a
-- finished checkpoint of another spec is never answered as this request's.
local spec, handoff = ARGV[9], ARGV[10] == '1'
if spec ~= '' and m[4] ~= spec then
  if handoff and not m[4] then
    return redis.error_reply('ERR a hand-off of a request that never came from the trainer')
  elseif handoff then
    return redis.error_reply('ERR a hand-off whose request (seed, prompt, sampling, ...) is not the one published')
  elseif m[4] then
    return redis.error_reply('ERR the checkpoint was made for another request under this id')
  end
end
if m[1] == '1' then
  return {-3, tonumber(m[2] or '0'), ''}
end
local cur = redis.call('GET', lease)
if cur and steal ~= '1' then
  local co, ce = string.match(cur, '^(%S+) ?(%S*)')
  -- a released lease is free, also in the millisecond its key lives on (see _RELEASE)
  if co ~= owner and not (ce == m[2] and ce == m[3]) then
    return {-5, redis.call('PTTL', lease), cur}
  end
end
-- Hybrid logical clock: never below the server time (us), so a rolled-back meta cannot
-- hand out an epoch issued before the rollback. Below 2^53: exact in Lua's doubles.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local epoch = math.max(tonumber(m[2] or '0') + 1, now)
local es = string.format('%d', epoch)
redis.call('HSET', meta, 'epoch', es, 'owner', owner, 'key', digest)
if spec ~= '' and not m[4] then redis.call('HSET', meta, 'spec', spec) end
redis.call('SET', lease, owner .. ' ' .. es, 'PX', ttl)
local data = redis.call('GET', tok) or ''
redis.call('RPUSH', hist, owner .. ' ' .. es .. ' ' .. (string.len(data) / 8) .. ' ' .. version .. ' ' .. weights)
-- The keys live `keep` s past the last generation worker's claim. Not an environment worker's:
-- its role has no EXPIRE (it may not shorten a finished checkpoint's life), and the request's
-- keys exist already (its generation worker claimed it first).
if not inherit then
  for _, k in ipairs({meta, hist, tok}) do redis.call('EXPIRE', k, keep) end
  if ep then redis.call('EXPIRE', ep, keep) end
end
if ep then
  return {es, 0, data, redis.call('GET', ep) or ''}
end
return {es, 0, data}
"""

# The fenced append of a whole flush, in one script call. KEYS are (meta, lease, tok) per
# request; ARGV = ttl_ms, owner, keep_s, then "epoch offset nbytes" of every request as one
# space-separated string and all their records concatenated as one string (two bulk strings
# instead of three per request: packing and parsing per-request arguments cost the client more
# than Redis spends in the script), then the writer's secret (one digest per call: a flush is one
# claimant's, `append_packed` groups by owner). Each request gets exactly the checks of a single
# append (epoch and secret, finished, offset) and its own outcome: the new length, -1 stale epoch
# (or not the lease holder's secret), -2 offset mismatch, -3 finished, or -4 when Redis refused
# one of its commands (a key of the wrong type), whose message follows. The reply is
# {"n1,n2,...", message of each -4 in order}. pcall keeps one request's error from aborting the
# others (earlier writes of a script are never rolled back). Only generation workers run it.
_APPEND_MANY = """
local ttl, owner, keep, heads, blob = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local digest = redis.sha1hex(ARGV[6])
local function one(meta, lease, tok, epoch, offset, data)
  local m = redis.call('HMGET', meta, 'epoch', 'finished', 'released', 'key')
  if m[1] ~= epoch or m[4] ~= digest then return -1 end
  if m[3] == epoch then return -1 end  -- released: a write after letting go must not take the lease back
  if m[2] == '1' then return -3 end
  if redis.call('STRLEN', tok) ~= tonumber(offset) * 8 then return -2 end
  local len = redis.call('APPEND', tok, data) / 8
  -- The claim's EXPIRE ran before the first append created this key (an append at 0 is the
  -- one that creates it: the offset check above saw it empty): give it the TTL now.
  if offset == '0' then redis.call('EXPIRE', tok, keep) end
  if redis.call('PEXPIRE', lease, ttl) == 0 then
    redis.call('SET', lease, owner .. ' ' .. epoch, 'PX', ttl)
  end
  return len
end
local codes, reply, i, at = {}, {''}, 0, 1
for epoch, offset, nbytes in string.gmatch(heads, '(%d+) (%d+) (%d+)') do
  local k, n = 3 * i, tonumber(nbytes)
  local ok, r = pcall(one, KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], epoch, offset, string.sub(blob, at, at + n - 1))
  at = at + n
  i = i + 1
  if ok then codes[i] = string.format('%d', r)
  else
    codes[i] = '-4'
    reply[#reply + 1] = type(r) == 'table' and r.err or tostring(r)
  end
end
if 3 * i ~= #KEYS or at ~= string.len(blob) + 1 then return redis.error_reply('ERR append batch does not add up') end
reply[1] = table.concat(codes, ',')
return reply
"""

# An episode's environment tokens (a tool result, an env turn) and the episode state that follows
# them, in one fenced step: the checks of an append (epoch and secret, finished, offset), then the
# records (logprobs 0), a history line `... env` for them and one that resumes the lease's model
# segment after them (a copy of the lease's own line, the last of the history), and the state. So
# a checkpoint never holds a tool result without the state that says it was answered, nor the
# reverse. ARGV: epoch, offset, ttl_ms, owner, keep_s, records, state, secret.
_APPEND_ENV = """
local meta, lease, tok, hist, ep = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local epoch, offset, ttl, owner, keep, data, state = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local m = redis.call('HMGET', meta, 'epoch', 'finished', 'released', 'key')
if m[1] ~= epoch or m[4] ~= redis.sha1hex(ARGV[8]) then return -1 end
if m[3] == epoch then return -1 end  -- released (see _RELEASE)
if m[2] == '1' then return -3 end
if redis.call('STRLEN', tok) ~= tonumber(offset) * 8 then return -2 end
local last = redis.call('LRANGE', hist, -1, -1)[1] or ''
local o, e, at, v, w = string.match(last, '^(%S+) (%S+) (%d+) (%S+) ?(%S*)$')
if e ~= epoch then return redis.error_reply('ERR the history does not end with this lease') end
local len
if offset == '0' then  -- the key is created here, with its TTL (no EXPIRE: see above)
  redis.call('SET', tok, data, 'EX', keep)
  len = string.len(data) / 8
else
  len = redis.call('APPEND', tok, data) / 8
end
local head = o .. ' ' .. e .. ' '
redis.call('RPUSH', hist, head .. offset .. ' ' .. v .. ' ' .. w .. ' env', head .. string.format('%d', len) .. ' ' .. v .. ' ' .. w)
redis.call('SET', ep, state, 'EX', keep)
redis.call('SET', lease, owner .. ' ' .. epoch, 'PX', ttl)
return len
"""

# An episode's state alone (a turn's pending tool calls, the end of the episode), fenced: the
# writer's epoch and secret, not finished, and the checkpoint exactly `at` tokens long (the state
# describes these tokens). ARGV: epoch, at, ttl_ms, owner, keep_s, state, secret.
_EPISODE = """
local meta, lease, tok, ep = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local epoch, at, ttl, owner, keep, state = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local m = redis.call('HMGET', meta, 'epoch', 'finished', 'released', 'key')
if m[1] ~= epoch or m[4] ~= redis.sha1hex(ARGV[7]) then return -1 end
if m[3] == epoch then return -1 end  -- released (see _RELEASE)
if m[2] == '1' then return -3 end
if redis.call('STRLEN', tok) ~= tonumber(at) * 8 then return -2 end
redis.call('SET', ep, state, 'EX', keep)
redis.call('SET', lease, owner .. ' ' .. epoch, 'PX', ttl)
return 1
"""

# ARGV: epoch, total, secret.
_FINISH = """
local meta, lease, tok = KEYS[1], KEYS[2], KEYS[3]
local total = tonumber(ARGV[2])
local m = redis.call('HMGET', meta, 'epoch', 'key')
if m[1] ~= ARGV[1] or m[2] ~= redis.sha1hex(ARGV[3]) then return -1 end
if redis.call('STRLEN', tok) / 8 ~= total then return -2 end
redis.call('HSET', meta, 'finished', '1')
redis.call('SET', lease, '- ' .. ARGV[1], 'PX', 1)  -- ends it (see above)
return 1
"""

# ARGV: epoch, ttl_ms, owner, secret.
_RENEW = """
local meta, lease = KEYS[1], KEYS[2]
local ttl = tonumber(ARGV[2])
local m = redis.call('HMGET', meta, 'epoch', 'finished', 'released', 'key')
if m[1] ~= ARGV[1] or m[4] ~= redis.sha1hex(ARGV[4]) then return -1 end
if m[2] == '1' then return -3 end
if m[3] == ARGV[1] then return -1 end  -- released: a late renewal must not take the lease back
redis.call('SET', lease, ARGV[3] .. ' ' .. ARGV[1], 'PX', ttl)
return 1
"""

# A release ends the lease (SET ... PX 1, see above) and marks its epoch released: a renewal of
# that epoch still in flight (a heartbeat racing the hand-off) would otherwise set the lease
# again, and the next claimer would wait out a whole TTL for a holder that has let go. The claim
# takes a released epoch's lease as free (the millisecond its key lives on). ARGV: epoch, secret.
_RELEASE = """
local meta, lease = KEYS[1], KEYS[2]
local m = redis.call('HMGET', meta, 'epoch', 'key')
if m[1] ~= ARGV[1] or m[2] ~= redis.sha1hex(ARGV[2]) then return -1 end
redis.call('SET', lease, '- ' .. ARGV[1], 'PX', 1)
redis.call('HSET', meta, 'released', ARGV[1])
return 1
"""

# A request forwarded unstarted from the fresh lane to a resume lane (a seeding engine hands off
# its queue, workers/handoff.py `forward_own_queue`): its spec recorded as its fresh claim would
# (see _CLAIM), so the hand-off is taken. 1 recorded (or already so), 0 another spec is recorded.
# ARGV: spec, keep_s.
_VOUCH = """
local meta = KEYS[1]
local m = redis.call('HMGET', meta, 'spec', 'epoch')
if m[1] then return m[1] == ARGV[1] and 1 or 0 end
redis.call('HSET', meta, 'spec', ARGV[1])
if not m[2] then redis.call('EXPIRE', meta, tonumber(ARGV[2])) end  -- created here: give it the claim's TTL
return 1
"""

# The trainer's redo (`CheckpointStore.reset`): one script, so no claim lands between the read of
# the epoch and the deletes.
_RESET = """
redis.replicate_commands()  -- TIME is not deterministic: replicate the effects (Redis < 7), as the claim does
local meta = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ok, raw = pcall(redis.call, 'HGET', meta, 'epoch')
local epoch = ok and tonumber(raw or '0') or nil
if epoch == nil then epoch = now + 60000000 end  -- unreadable: a minute past now, past any it issued
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
redis.call('HSET', meta, 'epoch', string.format('%d', math.max(epoch, now)), 'owner', '')
return 1
"""
