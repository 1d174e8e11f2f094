//! `hash_pod_name`: how upstream Dynamo derives a Kubernetes worker's instance id from its name.
//!
//! Upstream (`lib/runtime/src/discovery/kube/utils.rs`) feeds the name as a `&str` into rustc's
//! `DefaultHasher::new()` and keeps the low 53 bits. `DefaultHasher` is SipHash-1-3 with zero keys
//! today, and a `str` hashes as its UTF-8 bytes followed by one `0xFF` byte. We spell that out with
//! `siphasher` so a future toolchain changing `DefaultHasher` cannot silently change our ids; the
//! unit test below compares against this toolchain's `DefaultHasher` on every build, so such a
//! change shows up as a failing test rather than as unroutable workers.

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

use crate::ids::InstanceId;

/// Instance ids on Kubernetes fit in 53 bits (they travel through JSON numbers as f64-safe ints).
pub const POD_ID_MASK: u64 = 0x001F_FFFF_FFFF_FFFF;

/// The instance id upstream derives from a Pod (or metadata resource) name.
pub fn hash_pod_name(name: &str) -> InstanceId {
    let mut hasher = SipHasher13::new_with_keys(0, 0);
    hasher.write(name.as_bytes());
    // `impl Hash for str` appends this terminator so "ab","c" and "a","bc" differ.
    hasher.write_u8(0xFF);
    InstanceId(hasher.finish() & POD_ID_MASK)
}

/// Container mode's id (refused by this router, but needed to explain refusals and in vectors).
pub fn hash_container_name(pod: &str, container: &str) -> InstanceId {
    if container == "main" {
        hash_pod_name(pod)
    } else {
        hash_pod_name(&format!("{pod}-{container}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{DefaultHasher, Hash};

    const POD_HASH: &str = include_str!("testdata/pod_hash.json");

    fn vectors() -> serde_json::Value {
        serde_json::from_str(POD_HASH).expect("pod_hash.json is valid JSON")
    }

    #[test]
    fn worker_0_matches_the_upstream_vector() {
        assert_eq!(hash_pod_name("worker-0"), InstanceId(1_186_445_869_714_687));
        assert_eq!(hash_pod_name("worker-0").hex(), "43710f49c0cff");
    }

    #[test]
    fn every_pod_hash_vector_matches() {
        let doc = vectors();
        let list = doc["vectors"].as_array().expect("vectors array");
        assert!(list.len() >= 10);
        for v in list {
            let name = v["name"].as_str().expect("name");
            let id = v["instance_id"].as_u64().expect("instance_id");
            let hex = v["instance_id_hex"].as_str().expect("hex");
            assert_eq!(hash_pod_name(name), InstanceId(id), "{name}");
            assert_eq!(hash_pod_name(name).hex(), hex, "{name}");
        }
    }

    #[test]
    fn every_container_vector_matches() {
        let doc = vectors();
        let list = doc["container_vectors"]
            .as_array()
            .expect("container vectors array");
        assert!(!list.is_empty());
        for v in list {
            let pod = v["pod"].as_str().expect("pod");
            let container = v["container"].as_str().expect("container");
            let id = v["instance_id"].as_u64().expect("instance_id");
            assert_eq!(hash_container_name(pod, container), InstanceId(id));
            let cr = v["cr_name"].as_str().expect("cr_name");
            assert_eq!(hash_pod_name(cr), InstanceId(id));
        }
    }

    /// Pins our SipHash-1-3 to this toolchain's `DefaultHasher`, which is what upstream calls.
    #[test]
    fn matches_this_toolchains_default_hasher() {
        let names = [
            "worker-0",
            "",
            "a",
            "vllm-agg-0-vllmdecodeworker-7d9f8",
            "exactly8",
            "sixteen-bytes-xx",
            "ñ-unicode-名前",
            "a-much-longer-pod-name-that-spans-several-siphash-words-0123456789",
        ];
        for name in names {
            let mut h = DefaultHasher::new();
            name.hash(&mut h);
            assert_eq!(
                hash_pod_name(name),
                InstanceId(h.finish() & POD_ID_MASK),
                "{name}"
            );
        }
    }
}
