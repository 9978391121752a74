//! The core's micro-benchmarks under criterion: key parsing, fingerprinting 1 KiB and 64 KiB
//! JSON bodies (with raw SHA-256 of the same bytes as the floor), and the decision function.
//! The cases are defined once in `idem_bench::micro`, which the harness times too.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn core(c: &mut Criterion) {
    let mut group = c.benchmark_group("core");
    for mut case in idem_bench::micro::cases() {
        group.throughput(match case.bytes {
            Some(bytes) => Throughput::Bytes(bytes as u64),
            None => Throughput::Elements(1),
        });
        group.bench_function(case.id, |b| b.iter(|| (case.run)()));
    }
    group.finish();
}

criterion_group!(benches, core);
criterion_main!(benches);
