//! The fake OpenAI-compatible upstream as a program, for benches
//! (`scripts/bench-metering`): prints its address, serves until killed.
//!
//!   cargo run --release -p floodgate-testing --example fake-openai

fn main() {
    let fake = floodgate_testing::openai::FakeOpenAi::start();
    use std::io::Write as _;
    // The one line the bench script reads.
    let _ = writeln!(std::io::stdout(), "{}", fake.addr);
    loop {
        std::thread::park();
    }
}
