//! With the `cuda` feature: compiles the CUDA kernels with nvcc (`NVCC`, or
//! `nvcc` on PATH) into a fatbin holding machine code for `CUDA_COMPUTE_CAP`
//! (default 90), which the driver loads as it is, and PTX for later GPUs,
//! which it compiles on first use. The default build runs nothing here.

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "src/model/kernels/cuda/kernels.cu";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    // The headers `SOURCE` includes: every `.cuh` beside it.
    let dir = std::path::Path::new(SOURCE).parent().expect("a directory");
    for entry in std::fs::read_dir(dir).expect("the CUDA sources").flatten() {
        if entry.path().extension().is_some_and(|e| e == "cuh") {
            println!("cargo:rerun-if-changed={}", entry.path().display());
        }
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.fatbin");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let machine_code = format!("arch=compute_{cap},code=sm_{cap}");
    let ptx = format!("arch=compute_{cap},code=compute_{cap}");
    let status = Command::new(&nvcc)
        .args(["--fatbin", "-O3", "-std=c++17", "-gencode", &machine_code, "-gencode", &ptx, "-o"])
        .arg(&out)
        .arg(SOURCE)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {nvcc} to compile {SOURCE}: {e} (scripts/cuda/build.sh sets it up)"));
    assert!(status.success(), "{nvcc} failed on {SOURCE}");
}
