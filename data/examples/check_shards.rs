//! Times what a run checks of a prepared set: opening it (the manifest's
//! totals, file sizes, offsets) and each shard's whole check (checksums,
//! largest id, mask), as a run does the first time it touches the shard;
//! and a folder's lock taken and released.
//! The figures of BENCHMARKS.md:
//! `cargo run --release -p hlo-data --example check_shards -- DIR`.

use std::time::Instant;

use hlo_data::TokenShards;

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: check_shards DIR");
        std::process::exit(2);
    };
    let t = Instant::now();
    let shards = match TokenShards::open(std::path::Path::new(&dir)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    println!("open: {:.3} s", t.elapsed().as_secs_f64());
    let mut total = 0.0;
    let mut first = 0;
    for s in &shards.manifest.shards {
        // A shard's first sample: reading it checks the shard whole.
        let t = Instant::now();
        if let Err(e) = shards.sample(first, 1) {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
        let seconds = t.elapsed().as_secs_f64();
        let bytes = 5 * s.tokens + 8 * (s.samples + 1);
        println!(
            "{}: {} tokens, {:.2} GB checked in {seconds:.2} s ({:.2} GB/s)",
            s.name,
            s.tokens,
            bytes as f64 / 1e9,
            bytes as f64 / 1e9 / seconds
        );
        total += seconds;
        first += s.samples as usize;
    }
    println!("every shard: {total:.2} s");
    // What one writer a folder costs: taking and releasing a lock.
    let folder = std::env::temp_dir().join(format!("check-shards-lock-{}", std::process::id()));
    let t = Instant::now();
    for _ in 0..100 {
        drop(hlo_data::lock::FolderLock::create(&folder, "bench").expect("a lock"));
    }
    let per = t.elapsed().as_secs_f64() / 100.0;
    println!("a folder's lock taken and released: {:.2} ms", 1e3 * per);
    let _ = std::fs::remove_dir_all(&folder);
}
