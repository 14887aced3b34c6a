//! Print the composed Lua script the Redis store loads (to read it, load it
//! by hand, or benchmark it with `redis-benchmark EVALSHA`).

#![allow(clippy::print_stdout)]

fn main() {
    print!("{}", floodgate_redis::script::SOURCE.as_str());
}
