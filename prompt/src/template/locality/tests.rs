//! Which templates are message-local, and that the rewrite renders the original's text.

use minijinja::value::{Serde, Value};

use super::*;
use crate::template::{ChatTemplate, SpecialTokens, TemplateInput};
use continuum_protocol::kv::prompt::RENDER_FUEL;

fn fixture(path: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(path);
    let text = std::fs::read_to_string(path).unwrap();
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(config) => config["chat_template"].as_str().unwrap().to_owned(),
        Err(_) => text,
    }
}

fn syntax() -> SyntaxConfig {
    crate::template::hf_syntax()
}

#[test]
fn the_fixtures_own_templates_are_local_and_the_rich_one_is_not() {
    for path in [
        "models/TinyLlama_v1.1/tokenizer_config.json",
        "render/tiny-model/tokenizer_config.json",
    ] {
        assert!(rewrite(&fixture(path), syntax()).is_ok(), "{path}");
    }
    // A Qwen-style template: messages[0] in the header, a namespace counted in the loop.
    assert_eq!(
        rewrite(&fixture("render/rich.jinja"), syntax()),
        Err("messages is read outside the loop")
    );
}

#[test]
fn reading_later_messages_state_or_the_clock_is_not_local() {
    let refused = [
        (
            "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}",
            "the loop body reads loop.last, length, revindex or neighbours",
        ),
        (
            "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
            "messages is read outside the loop",
        ),
        (
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}",
            "the loop body sets, loops, breaks, calls a macro or includes",
        ),
        (
            "{% set sep = '|' %}{% for m in messages %}{{ sep }}{{ m.content }}{% endfor %}",
            "the loop body reads a name the template assigns",
        ),
        (
            "{% for m in messages %}{{ strftime_now('%d') }}{% endfor %}",
            "the loop body calls a function",
        ),
        (
            "{% for m in messages %}{{ messages[0].content }}{% endfor %}",
            "the loop body reads messages",
        ),
        (
            "{% for m in messages %}{{ loop.previtem }}{% endfor %}",
            "the loop body reads loop.last, length, revindex or neighbours",
        ),
        (
            "{% for m in messages %}{% break %}{% endfor %}",
            "the loop body sets, loops, breaks, calls a macro or includes",
        ),
        (
            "{% for m in messages if m.role != 'system' %}{{ m.content }}{% endfor %}",
            "the loop has a filter, recursion or an else",
        ),
        ("{{ 'no loop' }}", "no loop over messages"),
    ];
    for (source, why) in refused {
        assert_eq!(rewrite(source, syntax()), Err(why), "{source}");
    }
    let accepted = "{{ bos_token }}{% for m in messages %}{% if loop.first and m.role != 'user' %}\
        {{ raise_exception('user first') }}{% endif %}{{ m.role | upper }}: {{ m.content.strip() }}\
        {% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}\
        {% if add_generation_prompt %}A:{% endif %}";
    assert!(rewrite(accepted, syntax()).is_ok());
}

fn input(messages: &serde_json::Value) -> TemplateInput {
    TemplateInput {
        messages: Value::from(Serde(messages)),
        tools: Value::from(()),
        has_tools: false,
        add_generation_prompt: true,
        extra: Vec::new(),
        size_hint: 0,
    }
}

/// Whitespace control on the loop's tags (`-`, `+`, `trim_blocks`, `lstrip_blocks`, indented
/// tags on their own lines): the rewrite's text outside its marks is the original's, and
/// skipping the first messages leaves exactly their loop text out.
#[test]
fn the_rewrite_renders_the_original_text_under_every_whitespace_control() {
    let sources = [
        "{% for m in messages %}\n  <{{ m.role }}>{{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}A{% endif %}",
        "head\n  {%- for m in messages -%}\n  [{{ m.content }}]  \n  {%- endfor -%}\n  tail",
        "head\n  {%+ for m in messages +%}\n  [{{ loop.index }}{{ m.content }}]\n  {%+ endfor +%}\n  tail",
        "  {% for m in messages %}\n    {{ m.content }}\n  {% endfor %}\n  end\n",
        "{%- for m in messages %}{{- m.content -}} {% endfor -%}  \n\n x",
    ];
    let messages = serde_json::json!([
        {"role": "user", "content": " one "},
        {"role": "assistant", "content": "two\n"},
        {"role": "user", "content": "three"},
    ]);
    let first_two = serde_json::Value::from(messages.as_array().unwrap()[..2].to_vec());
    for source in sources {
        let template = ChatTemplate::from_jinja(source, SpecialTokens::default()).unwrap();
        assert!(template.is_local(false), "{source}");
        let whole = template
            .render(&input(&messages), RENDER_FUEL, 1 << 20)
            .unwrap();
        let local = template
            .render_local(&input(&messages), 0, RENDER_FUEL, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(local.text, whole, "{source}");
        let skipped = template
            .render_local(&input(&messages), 2, RENDER_FUEL, 1 << 20)
            .unwrap()
            .unwrap();
        // The loop text of the first two messages is what the skip left out.
        let two = template
            .render_local(&input(&first_two), 0, RENDER_FUEL, 1 << 20)
            .unwrap()
            .unwrap();
        let spliced = format!(
            "{}{}",
            &two.text[..two.loop_end],
            &skipped.text[skipped.loop_start..]
        );
        assert_eq!(spliced, whole, "{source}");
    }
}

#[test]
fn a_message_holding_a_mark_is_rendered_whole() {
    let template = ChatTemplate::from_jinja(
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    let mark = template.marks[1].clone();
    let messages = serde_json::json!([{"role": "user", "content": mark}]);
    assert_eq!(
        template.render_local(&input(&messages), 0, RENDER_FUEL, 1 << 20),
        Ok(None)
    );
}
