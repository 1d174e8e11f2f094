//! The tokenizer-free prompt-size estimate the load-only picker charges a request with.
//!
//! The load-only picker has no tokenizer, so it estimates coarsely: English averages about four
//! characters or three quarters of a word per token, and the larger of the two guards against
//! either count alone undershooting (long words, dense punctuation). A non-ASCII character (CJK,
//! most emoji) is usually a token of its own, so it counts one. Each chat message adds a few
//! tokens of template framing (role markers), and the assistant turn prime adds a few more.

/// Template framing per chat message (role header and separators).
pub const TOKENS_PER_MESSAGE: u64 = 4;

/// The assistant turn the chat template appends after the last message.
pub const TOKENS_PER_PROMPT: u64 = 3;

/// `char::is_whitespace` of the ASCII range: U+0009..=U+000D and U+0020.
const ASCII_WHITESPACE: [bool; 128] = {
    let mut table = [false; 128];
    let mut b = 0x09;
    while b <= 0x0d {
        table[b] = true;
        b += 1;
    }
    table[0x20] = true;
    table
};

/// Estimated tokens of one text: `max(ceil(ascii_chars / 4), ceil(words * 4 / 3))` plus one per
/// non-ASCII character. A word is a run of characters that are not `char::is_whitespace`.
///
/// Reads bytes: ASCII (one byte per character) is classified without decoding; only a non-ASCII
/// character is decoded, to ask whether it is Unicode whitespace.
pub fn estimate_text_tokens(text: &str) -> u64 {
    let bytes = text.as_bytes();
    if bytes.is_ascii() {
        // Nearly every prompt: one table lookup per byte and no branch on the class.
        let mut words: u64 = 0;
        let mut after_space = true;
        for &b in bytes {
            let space = ASCII_WHITESPACE[usize::from(b & 0x7f)];
            words += u64::from(after_space & !space);
            after_space = space;
        }
        let ascii = bytes.len() as u64;
        return ascii.div_ceil(4).max(words.saturating_mul(4).div_ceil(3));
    }
    let mut ascii: u64 = 0;
    let mut non_ascii: u64 = 0;
    let mut words: u64 = 0;
    let mut in_word = false;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let space = if b < 0x80 {
            ascii += 1;
            i += 1;
            // `char::is_whitespace` of the ASCII range: U+0009..=U+000D and U+0020.
            matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
        } else {
            non_ascii += 1;
            // `i` is a character boundary: it only ever advances by whole characters.
            let ch = text.get(i..).and_then(|rest| rest.chars().next());
            i += ch.map_or(1, char::len_utf8);
            ch.is_some_and(char::is_whitespace)
        };
        words += u64::from(!space && !in_word);
        in_word = !space;
    }
    ascii
        .div_ceil(4)
        .max(words.saturating_mul(4).div_ceil(3))
        .saturating_add(non_ascii)
}

/// Estimated prompt tokens of a chat request from its messages' text (one item per message, with
/// multi-part contents joined or passed as separate items of one message by the caller). An empty
/// request estimates to zero.
pub fn estimate_prompt_tokens<'a>(messages: impl IntoIterator<Item = &'a str>) -> u64 {
    let mut total: u64 = 0;
    let mut any = false;
    for text in messages {
        any = true;
        total = total
            .saturating_add(estimate_text_tokens(text))
            .saturating_add(TOKENS_PER_MESSAGE);
    }
    if any {
        total.saturating_add(TOKENS_PER_PROMPT)
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_dominate_for_long_words() {
        // 26 ASCII characters, one word: ceil(26 / 4) = 7 beats ceil(4 / 3) = 2.
        assert_eq!(estimate_text_tokens("abcdefghijklmnopqrstuvwxyz"), 7);
    }

    #[test]
    fn words_dominate_for_short_words() {
        // "a b c d e f": 11 characters -> 3; 6 words -> ceil(24 / 3) = 8.
        assert_eq!(estimate_text_tokens("a b c d e f"), 8);
    }

    #[test]
    fn non_ascii_characters_count_one_each() {
        // Four CJK characters, one word, no ASCII: max(0, ceil(4 / 3) = 2) + 4 = 6.
        assert_eq!(estimate_text_tokens("你好世界"), 6);
    }

    /// The character-by-character definition the byte loop must agree with.
    fn reference(text: &str) -> u64 {
        let (mut ascii, mut non_ascii, mut words, mut in_word) = (0u64, 0u64, 0u64, false);
        for ch in text.chars() {
            if ch.is_ascii() {
                ascii += 1;
            } else {
                non_ascii += 1;
            }
            if ch.is_whitespace() {
                in_word = false;
            } else if !in_word {
                in_word = true;
                words += 1;
            }
        }
        ascii
            .div_ceil(4)
            .max(words.saturating_mul(4).div_ceil(3))
            .saturating_add(non_ascii)
    }

    proptest::proptest! {
        #[test]
        fn the_byte_loop_agrees_with_the_character_definition(
            text in "[ a-z\t\n\u{0B}\u{0C}\r\u{1C}\u{85}\u{A0}\u{2003}\u{3000}é你😀.,]{0,64}",
            any_text in ".{0,32}",
            ascii_text in "[ -~\t\n\u{0B}\u{0C}\r\u{1C}\u{1F}\u{7F}]{0,64}",
        ) {
            proptest::prop_assert_eq!(estimate_text_tokens(&ascii_text), reference(&ascii_text));
            proptest::prop_assert_eq!(estimate_text_tokens(&text), reference(&text));
            proptest::prop_assert_eq!(estimate_text_tokens(&any_text), reference(&any_text));
        }
    }

    #[test]
    fn messages_add_template_framing() {
        // "hello" = max(2, 2) = 2; "hi there" = max(2, 3) = 3; framing 2 * 4 + 3.
        assert_eq!(estimate_prompt_tokens(["hello", "hi there"]), 2 + 3 + 8 + 3);
        assert_eq!(estimate_prompt_tokens(std::iter::empty::<&str>()), 0);
        assert_eq!(estimate_text_tokens(""), 0);
    }
}
