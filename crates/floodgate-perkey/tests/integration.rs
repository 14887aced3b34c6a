//! Per-key entries' integration tests, one binary for both backends: on
//! disk (redb and the hash index) and sharded in Redis (each test starts
//! its own `redis-server` or cluster).

mod in_redis;
mod on_disk;
