// examples/quickstart.rs: `cargo run -p acp-core --example quickstart`
use acp_core::{Dtype, Engine, EngineConfig, HostTensor, LoadRequest, SaveOptions};

fn main() -> acp_core::Result<()> {
    let dir = std::env::temp_dir().join(format!("acp-readme-{}", std::process::id()));
    let engine = Engine::open(
        EngineConfig::new(dir.join("ckpt"))
            .with_job(format!("readme-{}", std::process::id()))
            .with_ring_bytes(16 << 20)
            .with_shm_dir(&dir),
    )?;
    let bytes: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let handle = engine.save(
        7,
        &[HostTensor {
            name: "w",
            dtype: Dtype::F32,
            shape: &[2, 2],
            data: &bytes,
        }],
        &serde_json::json!({"epoch": 1}),
        &SaveOptions::default(),
    )?;
    handle.wait()?; // committed (the handle is also a Future; both watch for a stuck flush)
    let ckpt = engine.load(&LoadRequest::default())?;
    assert_eq!(ckpt.tensor("w").map(|t| t.data), Some(&bytes[..]));
    drop(ckpt);
    engine.close()?;
    std::fs::remove_dir_all(&dir).ok(); // this example's checkpoint and ring
    Ok(())
}
