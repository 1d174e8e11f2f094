//! Parity of the router's prompt rendering with Hugging Face `transformers`: rendered text and
//! token ids for every golden in tests/fixtures/render/goldens.json (TinyLlama from dynamo-llm
//! 1.6.1's fixtures, the mocker's tiny model, and a Qwen-style template with tools). Regenerate
//! the goldens with tests/fixtures/render/make_goldens.py.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use continuum_protocol::kv::hashing::{BlockSize, KV_HASH_SEED, local_block_hashes};
use continuum_protocol::kv::prompt::RenderLimits;
use continuum_router::kv::{ChatTemplate, PromptRenderer, SpecialTokens};

#[derive(serde::Deserialize)]
struct Goldens {
    goldens: Vec<Golden>,
}

#[derive(serde::Deserialize)]
struct Golden {
    model: String,
    template: String,
    case: String,
    request: serde_json::Value,
    rendered: String,
    tokens: Vec<u32>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn model_dir(model: &str) -> PathBuf {
    match model {
        "TinyLlama_v1.1" => fixtures().join("models/TinyLlama_v1.1"),
        "tiny-model" => fixtures().join("render/tiny-model"),
        other => panic!("golden names an unknown model {other}"),
    }
}

fn renderer(model: &str, template: &str) -> PromptRenderer {
    let dir = model_dir(model);
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let config = std::fs::read(dir.join("tokenizer_config.json")).unwrap();
    let template = match template {
        "config" => ChatTemplate::from_tokenizer_config_json(&config).unwrap(),
        file => {
            let source = std::fs::read_to_string(fixtures().join("render").join(file)).unwrap();
            let config: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&config).unwrap();
            ChatTemplate::from_jinja(&source, SpecialTokens::from_config(&config)).unwrap()
        }
    };
    PromptRenderer::new(
        Arc::new(tokenizer),
        Some(Arc::new(template)),
        RenderLimits::default(),
    )
}

#[tokio::test]
async fn rendering_and_token_ids_match_transformers() {
    let file: Goldens =
        serde_json::from_slice(&std::fs::read(fixtures().join("render/goldens.json")).unwrap())
            .unwrap();
    assert!(file.goldens.len() >= 24, "goldens cover three setups");
    let mut failures = Vec::new();
    for golden in &file.goldens {
        let renderer = renderer(&golden.model, &golden.template);
        let label = format!("{}/{}/{}", golden.model, golden.template, golden.case);
        let text = renderer.render_text(&golden.request).await.unwrap();
        if text.as_deref() != Some(golden.rendered.as_str()) {
            failures.push(format!(
                "{label}: rendered\n  ours: {text:?}\n  hf:   {:?}",
                golden.rendered
            ));
            continue;
        }
        let prepared = renderer
            .prepare(&golden.request, &[16, 32], None, None)
            .await
            .unwrap();
        if *prepared.tokens != *golden.tokens {
            failures.push(format!(
                "{label}: tokens\n  ours: {:?}\n  hf:   {:?}",
                prepared.tokens, golden.tokens
            ));
            continue;
        }
        let sixteen = BlockSize::new(16).unwrap();
        assert_eq!(
            prepared.hashes_for(sixteen).unwrap(),
            local_block_hashes(&golden.tokens, sixteen, KV_HASH_SEED).as_slice(),
            "{label}"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
