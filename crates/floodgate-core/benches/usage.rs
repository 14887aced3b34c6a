//! Reading a response's usage as it streams past (issue 47): a chat
//! completion's event stream of 200 chunks (~40 KB) and a JSON body of
//! ~4 KB, fed in 1 KiB pieces, in bytes a second.
//!
//! Run: `cargo bench -p floodgate-core --bench usage`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use floodgate_core::usage::{Framing, Scanner};

fn bodies() -> [(&'static str, Framing, String); 2] {
    let mut stream = String::new();
    for i in 0..200 {
        stream.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token {i} of the answer, \"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
        ));
    }
    stream.push_str("data: {\"id\":\"chatcmpl-9\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":200,\"total_tokens\":209}}\n\ndata: [DONE]\n\n");
    let json = format!(
        "{{\"id\":\"chatcmpl-9\",\"object\":\"chat.completion\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}}}}],\"usage\":{{\"prompt_tokens\":9,\"completion_tokens\":200,\"total_tokens\":209}}}}",
        "lorem ipsum dolor sit amet, ".repeat(140)
    );
    [("event_stream", Framing::EventStream, stream), ("json", Framing::Json, json)]
}

fn usage(c: &mut Criterion) {
    let mut g = c.benchmark_group("usage_scan");
    for (name, framing, body) in bodies() {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut s = Scanner::new(framing);
                for piece in body.as_bytes().chunks(1024) {
                    s.feed(black_box(piece));
                }
                black_box(s.usage())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, usage);
criterion_main!(benches);
