//! Tests of [`PromptRenderer`]: every bound of the seed, request shapes, and that no body panics.

use std::path::Path;

use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::template::SpecialTokens;
use continuum_protocol::kv::prompt::prompt_block_hashes;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models/TinyLlama_v1.1")
        .join(name)
}

fn tokenizer() -> Arc<tokenizers::Tokenizer> {
    Arc::new(tokenizers::Tokenizer::from_file(fixture("tokenizer.json")).unwrap())
}

fn tinyllama(limits: RenderLimits) -> PromptRenderer {
    let config = std::fs::read(fixture("tokenizer_config.json")).unwrap();
    let template = ChatTemplate::from_tokenizer_config_json(&config).unwrap();
    PromptRenderer::new(tokenizer(), Some(Arc::new(template)), limits)
}

fn with_template(source: &str, limits: RenderLimits) -> PromptRenderer {
    let template = ChatTemplate::from_jinja(source, SpecialTokens::default()).unwrap();
    PromptRenderer::new(tokenizer(), Some(Arc::new(template)), limits)
}

fn chat(text: &str) -> serde_json::Value {
    json!({"model": "m", "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn chat_is_rendered_tokenized_and_hashed_per_block_size() {
    let renderer = tinyllama(RenderLimits::default());
    let text = "hello world ".repeat(20);
    let prepared = renderer
        .prepare(&chat(&text), &[32, 16, 32], Some("lora"), None)
        .await
        .unwrap();
    let rendered = format!("<|user|>\n{text}<|end|>\n");
    let want = tokenizer().encode(rendered.as_str(), false).unwrap();
    assert_eq!(&*prepared.tokens, want.get_ids());
    assert_eq!(prepared.isl, prepared.tokens.len());
    let plan = block_plan(&[16, 32]).unwrap();
    assert_eq!(
        prepared.hashes,
        prompt_block_hashes(&prepared.tokens, &plan, Some("lora"), None)
    );
    assert_eq!(
        prepared.hashes_for(plan[0]).map(<[_]>::len),
        Some(prepared.isl / 16)
    );
    assert!(prepared.isl >= 32, "the prompt spans whole blocks");
}

#[tokio::test]
async fn completions_prompts_are_text_ids_or_a_batch_of_one() {
    let renderer = PromptRenderer::new(tokenizer(), None, RenderLimits::default());
    let text = renderer
        .prepare(&json!({"prompt": "hello world"}), &[16], None, None)
        .await
        .unwrap();
    let want = tokenizer().encode("hello world", false).unwrap();
    assert_eq!(&*text.tokens, want.get_ids());
    let one = renderer
        .prepare(&json!({"prompt": ["hello world"]}), &[16], None, None)
        .await
        .unwrap();
    assert_eq!(one.tokens, text.tokens);
    let ids: Vec<u32> = (0..40).collect();
    for body in [json!({"prompt": ids}), json!({"prompt": [ids]})] {
        let prepared = renderer.prepare(&body, &[16], None, None).await.unwrap();
        assert_eq!(&*prepared.tokens, ids.as_slice());
        assert_eq!(prepared.hashes[0].1.len(), 2);
    }
    for body in [
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": [1, -1]}),
        json!({"prompt": [4_294_967_296u64]}),
        json!({"prompt": 7}),
        json!({}),
        json!("just a string"),
    ] {
        let err = renderer
            .prepare(&body, &[16], None, None)
            .await
            .unwrap_err();
        assert!(matches!(err, PrepareError::BadRequest(_)), "{body}: {err}");
        assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);
    }
    let err = renderer
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(err, PrepareError::NoTemplate);
    assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);
}

#[tokio::test]
async fn unsupported_block_sizes_fail_before_rendering() {
    let renderer = tinyllama(RenderLimits::default());
    for sizes in [&[8u32][..], &[16, 32, 64], &[70_000]] {
        let err = renderer
            .prepare(&chat("hi"), sizes, None, None)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), PrepareFailureKind::Unsupported, "{sizes:?}");
    }
}

#[tokio::test]
async fn token_and_text_caps_are_prompt_too_large() {
    let limits = RenderLimits {
        max_tokens: 8,
        ..RenderLimits::default()
    };
    let renderer = tinyllama(limits);
    let err = renderer
        .prepare(&chat(&"word ".repeat(20)), &[16], None, None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, PrepareError::TooManyTokens { limit: 8, .. }),
        "{err}"
    );
    assert_eq!(err.kind(), PrepareFailureKind::PromptTooLarge);
    let ids: Vec<u32> = (0..9).collect();
    let err = renderer
        .prepare(&json!({"prompt": ids}), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        PrepareError::TooManyTokens {
            tokens: 9,
            limit: 8
        }
    );

    // The seed's 1 MiB text cap: a chat whose rendering passes it, and a raw prompt that does.
    let renderer = tinyllama(RenderLimits::default());
    let huge = "x".repeat((1 << 20) + 1);
    for body in [chat(&huge), json!({"prompt": huge})] {
        let err = renderer
            .prepare(&body, &[16], None, None)
            .await
            .unwrap_err();
        assert_eq!(err, PrepareError::RenderedTooLarge { limit: 1 << 20 });
        assert_eq!(err.kind(), PrepareFailureKind::PromptTooLarge);
    }
}

#[tokio::test]
async fn the_seed_token_cap_holds_for_a_large_prompt() {
    // 1 MiB of text just under the cap tokenizes to far fewer than 1,048,576 tokens with a real
    // tokenizer, so the token cap is exercised through token-id prompts.
    let renderer = PromptRenderer::new(tokenizer(), None, RenderLimits::default());
    let ids = vec![1u32; 1_048_577];
    let err = renderer
        .prepare(&json!({"prompt": ids}), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        PrepareError::TooManyTokens {
            tokens: 1_048_577,
            limit: 1_048_576
        }
    );
}

#[tokio::test]
async fn fuel_include_and_malformed_templates_are_render_unavailable() {
    // The seed's 5,000,000 instructions take longer than the 2 s deadline in a debug build, so
    // this test gives the deadline room; `template::tests` runs the seed's fuel itself.
    let limits = RenderLimits {
        fuel: 200_000,
        ..RenderLimits::default()
    };
    let spin = with_template(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        limits,
    );
    let err = spin
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(err, PrepareError::OutOfFuel);
    assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);

    let include = with_template("{% include '/etc/passwd' %}", RenderLimits::default());
    let err = include
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert!(matches!(err, PrepareError::Template(_)), "{err}");
    assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);

    let runtime_error = with_template("{{ messages[0].content.nope() }}", RenderLimits::default());
    let err = runtime_error
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);

    assert!(ChatTemplate::from_jinja("{% if %}", SpecialTokens::default()).is_err());
    assert!(ChatTemplate::from_tokenizer_config_json(b"{\"chat_template\": \"{{\"}").is_err());
}

#[tokio::test(start_paused = true)]
async fn permit_wait_times_out_when_every_permit_is_busy() {
    let limits = RenderLimits {
        permits: 1,
        ..RenderLimits::default()
    };
    let renderer = tinyllama(limits);
    let held = Arc::clone(&renderer.permits.0)
        .acquire_owned()
        .await
        .unwrap();
    let err = renderer
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(err, PrepareError::PermitTimeout(Duration::from_millis(20)));
    assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);
    drop(held);
    renderer
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap();
}

#[tokio::test]
async fn deadline_fires_and_the_permit_stays_with_the_running_render() {
    // The template calls `wait()`, which blocks its render thread until the test says so: a
    // render that is certainly slower than its deadline, with no clock in the assertion.
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(gate);
    let mut template = ChatTemplate::from_jinja("{{ wait() }}x", SpecialTokens::default()).unwrap();
    template.env_mut().add_function("wait", move || {
        let _ = gate.lock().map(|gate| gate.recv());
        Ok::<_, minijinja::Error>(Value::from(()))
    });
    let limits = RenderLimits {
        permits: 1,
        deadline: Duration::from_millis(10),
        ..RenderLimits::default()
    };
    let renderer = PromptRenderer::new(tokenizer(), Some(Arc::new(template)), limits);
    let err = renderer
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert_eq!(err, PrepareError::Deadline(Duration::from_millis(10)));
    assert_eq!(err.kind(), PrepareFailureKind::RenderUnavailable);
    // The abandoned render still holds the only permit, so a second request waits and times
    // out rather than stacking another render on the blocking pool.
    assert_eq!(renderer.permits.available(), 0);
    let err = renderer
        .prepare(&chat("hi"), &[16], None, None)
        .await
        .unwrap_err();
    assert!(matches!(err, PrepareError::PermitTimeout(_)), "{err}");
    release.send(()).unwrap();
    let permit = Arc::clone(&renderer.permits.0)
        .acquire_owned()
        .await
        .unwrap();
    drop(permit);
    assert_eq!(renderer.permits.available(), 1);
}

#[tokio::test]
async fn renderers_can_share_one_permit_pool() {
    let permits = RenderPermits::new(1);
    let a = tinyllama(RenderLimits::default()).with_permits(permits.clone());
    let held = Arc::clone(&permits.0).acquire_owned().await.unwrap();
    assert!(matches!(
        a.prepare(&chat("hi"), &[16], None, None).await,
        Err(PrepareError::PermitTimeout(_))
    ));
    drop(held);
    assert!(a.prepare(&chat("hi"), &[16], None, None).await.is_ok());
    assert!(RenderPermits::for_this_machine().available() >= 4);
}

#[test]
fn text_parts_are_flattened_and_other_parts_kept() {
    let text = json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
    assert_eq!(flatten_text_parts(&text)["content"], json!("a\nb"));
    let image = json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]});
    assert_eq!(*flatten_text_parts(&image), image);
    let empty = json!({"role": "user", "content": []});
    assert_eq!(flatten_text_parts(&empty)["content"], json!(""));
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,40}".prop_map(serde_json::Value::from),
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("system"),
            Just("text")
        ]
        .prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
            prop::collection::btree_map(
                prop_oneof![
                    Just("role".to_string()),
                    Just("content".to_string()),
                    Just("type".to_string()),
                    Just("text".to_string()),
                    Just("messages".to_string()),
                    Just("prompt".to_string()),
                    Just("tools".to_string()),
                    "[a-z]{1,6}"
                ],
                inner,
                0..5
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Built once: loading the tokenizer dominates a case in a debug build.
static FUZZ_RENDERERS: std::sync::LazyLock<[PromptRenderer; 2]> = std::sync::LazyLock::new(|| {
    [
        tinyllama(RenderLimits::default()),
        with_template(
            "{% for m in messages %}{{ m.role }}{{ m.content | tojson }}{% if m.content is string %}{{ m.content.strip() }}{% endif %}{% endfor %}{{ tools | tojson }}",
            RenderLimits::default(),
        ),
    ]
});

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Arbitrary bodies end in `Ok` or a labelled error, never a panic, through the real
    /// TinyLlama template and one that touches every message field.
    #[test]
    fn arbitrary_bodies_never_panic(
        messages in json_value(),
        prompt in json_value(),
        tools in json_value(),
        sizes in prop::collection::vec(0u32..70_000, 0..4),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let bodies = [
            json!({"messages": messages.clone(), "tools": tools}),
            json!({"messages": [{"role": "user", "content": messages}]}),
            json!({"prompt": prompt}),
        ];
        for renderer in FUZZ_RENDERERS.iter() {
            for body in &bodies {
                let result = runtime.block_on(renderer.prepare(body, &sizes, Some("l"), Some("s")));
                if let Err(err) = result {
                    let _ = err.kind().label();
                }
            }
        }
    }
}
