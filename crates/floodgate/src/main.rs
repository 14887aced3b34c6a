//! floodgate command line.

fn main() {}
