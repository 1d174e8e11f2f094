//! The `kubernetes_pods` fleet view: ready member Pods become workers with no card, no capacity
//! and no publishers (Pods carry none), so pickers rotate round-robin across them.

use crate::discovery::records::Role;
use crate::discovery::view::{NamespaceView, Worker};
use crate::ids::Namespace;
use crate::time::UnixMillis;

use super::pods::{PodMember, PodRole};

/// The view of `namespace` for a member set. A worker already in `previous` with the same role,
/// model and component keeps its `first_seen` and `last_updated`.
pub fn pod_view(
    namespace: &Namespace,
    members: &[PodMember],
    previous: &NamespaceView,
    now: UnixMillis,
) -> NamespaceView {
    let workers = members
        .iter()
        .filter(|m| &m.namespace == namespace)
        .map(|m| {
            let role = match m.role {
                PodRole::Prefill => Role::Prefill,
                PodRole::Decode => Role::Decode,
                PodRole::Aggregated => Role::Aggregated,
            };
            let component = m.component.clone().unwrap_or_default();
            let mut worker = Worker::new(m.key(), component, role, now);
            worker.model = Some(m.model.clone());
            if let Some(old) = previous.worker(m.instance_id)
                && old.role == worker.role
                && old.model == worker.model
                && old.component == worker.component
            {
                worker.first_seen = old.first_seen;
                worker.last_updated = old.last_updated;
            }
            worker
        });
    NamespaceView::from_parts(namespace.clone(), workers, std::iter::empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::InstanceId;

    fn member(name: &str, role: PodRole, model: &str) -> PodMember {
        PodMember {
            namespace: Namespace::new("dyn"),
            instance_id: crate::kube::hash_pod_name(name),
            role,
            model: model.into(),
            component: Some("VllmWorker".into()),
            pod_name: name.into(),
        }
    }

    #[test]
    fn members_become_card_less_workers_that_keep_first_seen() {
        let ns = Namespace::new("dyn");
        let empty = NamespaceView::new(ns.clone());
        let first = pod_view(
            &ns,
            &[member("worker-0", PodRole::Decode, "m")],
            &empty,
            UnixMillis(1),
        );
        let w = first
            .worker(crate::kube::hash_pod_name("worker-0"))
            .expect("worker");
        assert_eq!(
            (w.role, w.model.as_deref(), w.capacity.total_kv_blocks),
            (Role::Decode, Some("m"), None)
        );
        assert_eq!(first.publishers().len(), 0);
        let members = [
            member("worker-0", PodRole::Decode, "m"),
            member("worker-1", PodRole::Prefill, "m"),
        ];
        let second = pod_view(&ns, &members, &first, UnixMillis(9));
        let w0 = second
            .worker(crate::kube::hash_pod_name("worker-0"))
            .expect("kept");
        assert_eq!(w0.first_seen, UnixMillis(1));
        let w1 = second
            .worker(crate::kube::hash_pod_name("worker-1"))
            .expect("new");
        assert_eq!(w1.first_seen, UnixMillis(9));
        assert!(second.worker(InstanceId(1)).is_none());
        assert!(!first.same_content(&second));
    }
}
