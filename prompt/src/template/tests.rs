//! Tests of [`ChatTemplate`]: configs, special tokens, transformers' environment, bounds.

use super::*;

fn input(messages: serde_json::Value) -> TemplateInput {
    TemplateInput {
        messages: Value::from(Serde(&messages)),
        tools: Value::from(()),
        has_tools: false,
        add_generation_prompt: true,
        extra: Vec::new(),
        size_hint: 0,
    }
}

#[test]
fn config_chat_template_as_string_list_or_missing() {
    let t = ChatTemplate::from_tokenizer_config_json(
        br#"{"chat_template": "{{ bos_token }}{{ messages[0].content }}", "bos_token": {"content": "<s>"}}"#,
    )
    .unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    assert_eq!(
        t.render(&input(msgs.clone()), RENDER_FUEL, 1 << 20)
            .unwrap(),
        "<s>hi"
    );

    let listed = ChatTemplate::from_tokenizer_config_json(
        br#"{"chat_template": [{"name": "tool_use", "template": "T{{ tools|length }}"},
                               {"name": "default", "template": "D"}]}"#,
    )
    .unwrap();
    assert_eq!(
        listed
            .render(&input(msgs.clone()), RENDER_FUEL, 100)
            .unwrap(),
        "D"
    );
    let mut with_tools = input(msgs);
    with_tools.tools = Value::from(Serde(serde_json::json!([{"type": "function"}])));
    with_tools.has_tools = true;
    assert_eq!(listed.render(&with_tools, RENDER_FUEL, 100).unwrap(), "T1");

    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(
            br#"{"chat_template": [{"name": "x", "template": ""}]}"#
        ),
        Err(TemplateError::NoDefaultTemplate)
    ));
    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(br#"{"bos_token": "<s>"}"#),
        Err(TemplateError::NoChatTemplate)
    ));
    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(b"[1, 2]"),
        Err(TemplateError::Config(_))
    ));
    assert!(matches!(
        ChatTemplate::from_jinja("{% for %}", SpecialTokens::default()),
        Err(TemplateError::Syntax(_))
    ));
}

#[test]
fn special_tokens_are_strings_or_added_tokens_and_null_is_absent() {
    let config: serde_json::Map<String, serde_json::Value> = serde_json::from_str(
        r#"{"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>",
            "pad_token": null, "unk_token": 7}"#,
    )
    .unwrap();
    let special = SpecialTokens::from_config(&config);
    assert_eq!(special.bos_token.as_deref(), Some("<s>"));
    assert_eq!(special.eos_token.as_deref(), Some("</s>"));
    assert_eq!(special.pad_token, None);
    assert_eq!(special.unk_token, None);
}

#[test]
fn python_methods_raise_exception_and_whitespace_control_match_transformers() {
    let t = ChatTemplate::from_jinja(
        "{% for m in messages %}\n  {{ m.content.strip() }}{% if m.role.startswith('u') %}!{% endif %}\n{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    let msgs =
        serde_json::json!([{"role": "user", "content": "  a  "}, {"role": "bot", "content": "b"}]);
    // Checked against jinja2 3.1.6 with trim_blocks and lstrip_blocks: the newlines after block
    // tags go, the indentation before an expression stays.
    assert_eq!(
        t.render(&input(msgs.clone()), RENDER_FUEL, 100).unwrap(),
        "  a!  b"
    );

    let raising = ChatTemplate::from_jinja(
        "{{ raise_exception('roles must alternate') }}",
        SpecialTokens::default(),
    )
    .unwrap();
    match raising.render(&input(msgs), RENDER_FUEL, 100) {
        Err(RenderFailure::Template(message)) => {
            assert!(message.contains("roles must alternate"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

/// Key order is the request's own (serde_json and minijinja `preserve_order`), as Python
/// dicts keep it: `k` before `e`.
#[test]
fn tojson_is_python_json_dumps() {
    let t = ChatTemplate::from_jinja(
        "{{ messages[0] | tojson }}|{{ messages[1] | tojson(indent=2) }}|{{ messages[2] | tojson }}",
        SpecialTokens::default(),
    )
    .unwrap();
    let msgs = serde_json::json!([
        {"a": [1, 2.5, true, null], "b": "<é>\n"},
        {"k": [1, {}], "e": []},
        "x"
    ]);
    assert_eq!(
        t.render(&input(msgs), RENDER_FUEL, 1000).unwrap(),
        "{\"a\": [1, 2.5, true, null], \"b\": \"<é>\\n\"}|{\n  \"k\": [\n    1,\n    {}\n  ],\n  \"e\": []\n}|\"x\""
    );
}

#[test]
fn strftime_covers_the_codes_templates_use() {
    let at = time::macros::datetime!(2026-03-05 14:07:09 UTC);
    assert_eq!(
        strftime(at, "%d %B %Y, %b %-d %a %A %H:%M:%S %I%p %j %y %% %Q"),
        "05 March 2026, Mar 5 Thu Thursday 14:07:09 02PM 064 26 % %Q"
    );
}

#[test]
fn includes_fail_without_a_loader_and_fuel_and_size_are_bounded() {
    let include =
        ChatTemplate::from_jinja("{% include 'secrets.txt' %}", SpecialTokens::default()).unwrap();
    let msgs = serde_json::json!([]);
    assert!(matches!(
        include.render(&input(msgs.clone()), RENDER_FUEL, 100),
        Err(RenderFailure::Template(_))
    ));
    let spin = ChatTemplate::from_jinja(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    assert_eq!(
        spin.render(&input(msgs.clone()), RENDER_FUEL, 100),
        Err(RenderFailure::OutOfFuel)
    );
    let big = ChatTemplate::from_jinja(
        "{% for i in range(3000) %}{{ 'x' * 1000 }}{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    assert_eq!(
        big.render(&input(msgs.clone()), RENDER_FUEL, 1 << 20),
        Err(RenderFailure::TooLarge)
    );
    assert_eq!(
        big.render(&input(msgs), RENDER_FUEL, 3_000_000)
            .map(|s| s.len()),
        Ok(3_000_000)
    );
}
