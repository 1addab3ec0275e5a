//! Loads a model directory with rloo and saves it again, e.g. to check that
//! transformers loads what rloo writes:
//!
//! ```sh
//! cargo run --example resave -- tests/fixtures/models/llama-causal /tmp/llama-resaved
//! python scripts/fixtures/make_fixtures.py roundtrip /tmp/llama-resaved llama-causal
//! ```

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [src, dst] = args.as_slice() else {
        anyhow::bail!("usage: resave SRC_MODEL_DIR DST_DIR");
    };
    let model = rloo::model::Model::load(src, &candle_core::Device::Cpu)?;
    model.save(dst)?;
    println!("{} -> {} ({} tensors)", src.display(), dst.display(), model.params().len());
    Ok(())
}
