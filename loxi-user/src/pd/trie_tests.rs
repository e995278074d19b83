use super::*;
use crate::request::ChatMessage;

fn text(s: &str) -> Vec<u32> {
    std::iter::once(TEXT_TAG)
        .chain(s.chars().map(u32::from))
        .collect()
}

fn all(_: EpIdx) -> bool {
    true
}

#[test]
fn longest_match_names_the_endpoint_holding_the_longest_prefix() {
    let mut t = PrefixTrie::new(1000);
    t.insert(&text("You are a helpful assistant. Say hi"), 1);
    t.insert(&text("You are a pirate. Say hi"), 2);
    // Shares "You are a helpful assistant. " (29 chars) with endpoint 1's key, "You are a " (10)
    // with endpoint 2's.
    let m = t
        .longest_match(&text("You are a helpful assistant. Tell a joke"), all)
        .expect("match");
    assert_eq!(m.matched, 1 + 29);
    assert_eq!(m.holders, vec![1]);
    let m = t.longest_match(&text("You are a pi"), all).expect("match");
    assert_eq!(m.matched, 1 + 12);
    assert_eq!(m.holders, vec![2]);
    // The common stem is held by both.
    let m = t.longest_match(&text("You are a cat"), all).expect("match");
    assert_eq!(m.matched, 1 + 10);
    assert_eq!(m.holders, vec![1, 2]);
    // Nothing past the shared tag.
    let m = t.longest_match(&text("Hello"), all).expect("tag");
    assert_eq!((m.matched, m.holders), (1, vec![1, 2]));
    // A text key never matches a token key with the same numbers.
    let mut tokens = text("You are");
    tokens[0] = TOKENS_TAG;
    assert_eq!(t.longest_match(&tokens, all), None);
}

#[test]
fn an_endpoint_not_accepted_is_skipped_for_the_next_holder() {
    let mut t = PrefixTrie::new(1000);
    t.insert(&text("shared preamble: alpha"), 0);
    t.insert(&text("shared preamble: beta"), 3);
    let key = text("shared preamble: alpha and more");
    assert_eq!(t.longest_match(&key, all).expect("m").holders, vec![0]);
    // Endpoint 0 unhealthy: endpoint 3 holds "shared preamble: " (17 chars).
    let m = t.longest_match(&key, |ep| ep != 0).expect("m");
    assert_eq!((m.matched, m.holders), (1 + 17, vec![3]));
    assert_eq!(t.longest_match(&key, |_| false), None);
}

#[test]
fn stored_symbols_stay_within_the_capacity_and_the_oldest_leaves_go_first() {
    let mut t = PrefixTrie::new(100);
    // 20 distinct keys of 1 + 10 symbols each: 220 symbols offered to a 100-symbol trie.
    let keys: Vec<Vec<u32>> = (0..20)
        .map(|i| text(&format!("{}key-{i:05}", char::from(b'a' + i as u8))))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        t.insert(k, i % 2);
        assert!(t.stored() <= 100, "after {i}: {}", t.stored());
    }
    // The newest key is whole; the first one is gone.
    let last = t.longest_match(&keys[19], all).expect("newest kept");
    assert_eq!(last.matched, keys[19].len());
    // The first key's own leaf is gone: only the shared tag node (1 symbol) still matches.
    assert_eq!(t.longest_match(&keys[0], all).expect("tag").matched, 1);
    // The tag node (1) and 10-symbol leaves: 101 symbols evict down to 7/8 of 100, i.e. 81.
    assert_eq!(t.stored(), 81);
}

#[test]
fn a_touched_prefix_survives_eviction_of_colder_ones() {
    let mut t = PrefixTrie::new(60);
    t.insert(&text("hot-prefix-000"), 0); // 15 symbols
    for i in 0..10 {
        t.insert(&text(&format!("{i}cold-{i:08}")), 1); // 15 symbols each
        t.insert(&text("hot-prefix-000"), 0);
        assert!(t.stored() <= 60);
    }
    assert_eq!(
        t.longest_match(&text("hot-prefix-000"), all)
            .expect("hot")
            .matched,
        15
    );
}

#[test]
fn a_removed_endpoint_is_forgotten_and_the_others_renumbered() {
    let mut t = PrefixTrie::new(1000);
    t.insert(&text("common/one"), 0);
    t.insert(&text("common/two"), 1);
    t.insert(&text("common/three"), 2);
    let before = t.stored();
    // Endpoint 1 removed: 0 stays 0, 2 becomes 1.
    t.remap(|ep| match ep {
        0 => Some(0),
        2 => Some(1),
        _ => None,
    });
    let m = t.longest_match(&text("common/x"), all).expect("m");
    assert_eq!((m.matched, m.holders), (1 + 7, vec![0, 1]));
    // Old endpoint 2 (now 1) holds "common/t"; endpoint 1's "wo" is gone.
    let m = t.longest_match(&text("common/two"), all).expect("m");
    assert_eq!((m.matched, m.holders), (1 + 8, vec![1]));
    let m = t.longest_match(&text("common/three"), all).expect("m");
    assert_eq!((m.matched, m.holders), (1 + 12, vec![1]));
    // "wo" (endpoint 1's own leaf) was freed.
    assert_eq!(t.stored(), before - 2);
    t.forget(0);
    t.forget(1);
    assert_eq!((t.stored(), t.nodes()), (0, 1));
    assert_eq!(t.longest_match(&text("common/one"), all), None);
}

#[test]
fn keys_come_from_tokens_then_token_prompts_then_text() {
    let meta = |p: Prompt| RequestMeta {
        prompt: Some(p),
        ..RequestMeta::default()
    };
    let m = meta(Prompt::Text("héllo".into()));
    assert_eq!(key_of(&m, None), Some(text("héllo")));
    assert_eq!(key_of(&m, Some(&[7, 8])), Some(vec![TOKENS_TAG, 7, 8]));
    assert_eq!(
        key_of(&meta(Prompt::TokenIds(vec![3, 4])), None),
        Some(vec![TOKENS_TAG, 3, 4])
    );
    let chat = meta(Prompt::Messages(vec![ChatMessage {
        role: "user".into(),
        content: "hi".into(),
    }]));
    assert_eq!(key_of(&chat, None), Some(text("user\u{1}hi\u{0}")));
    assert_eq!(key_of(&meta(Prompt::Text(String::new())), None), None);
    assert_eq!(key_of(&RequestMeta::default(), None), None);
    let long = meta(Prompt::Text("x".repeat(KEY_MAX + 10)));
    assert_eq!(key_of(&long, None).expect("key").len(), 1 + KEY_MAX);
}
