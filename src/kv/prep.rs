//! The production [`KvPromptPrep`]: the fleet's pinned tokenizer and chat template (from
//! `continuum_actors::kv_artifacts`) rendered and hashed by [`PromptRenderer`].
//!
//! One renderer per [`ArtifactKey`] is kept (at most [`MAX_RENDERERS`], the artifact loader's own
//! tokenizer bound), so a template is compiled once per artifact set, not per request; all
//! renderers share one permit pool. Requests never wait on a load: a model whose artifacts are
//! not loaded, not agreed on or not pinned scores without a KV term.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use continuum_actors::kv_artifacts::{
    ArtifactRegistry, ArtifactUnavailable, ModelArtifacts, PromptFormatterSource,
};
use continuum_actors::kv_artifacts::{KvArtifactMetrics, KvArtifactResult};
use continuum_actors::metrics::Metrics;
use continuum_protocol::kv::artifacts::ArtifactKey;
use continuum_protocol::kv::prompt::{PrepareFailureKind, RenderLimits};
use futures::future::BoxFuture;
use tracing::warn;

use crate::kv::render::available_cpus;
use crate::kv::{ChatTemplate, PrepareError, PromptRenderer, RenderPermits, SpecialTokens};
use continuum_protocol::picker::KvUnavailable;

use crate::kv::{KvPrepRequest, KvPromptPrep, PreparedPrompt};

/// Compiled renderers kept at once (the loader keeps at most 16 tokenizers too).
pub const MAX_RENDERERS: usize = 16;

/// Models whose "unsupported block size" was already logged are remembered up to this many.
const MAX_LOGGED_MODELS: usize = 1024;

/// Renders with the artifacts the fleet's cards name and the operator pinned.
pub struct ArtifactPromptPrep {
    artifacts: ArtifactRegistry,
    permits: RenderPermits,
    limits: RenderLimits,
    renderers: Mutex<HashMap<ArtifactKey, Arc<PromptRenderer>>>,
    unsupported_logged: Mutex<std::collections::HashSet<String>>,
    metrics: Option<Arc<KvArtifactMetrics>>,
}

impl ArtifactPromptPrep {
    pub fn new(artifacts: ArtifactRegistry, metrics: Option<Metrics>) -> Self {
        let cpus = available_cpus();
        Self {
            artifacts,
            permits: RenderPermits::for_this_machine(),
            limits: RenderLimits::for_cpus(cpus),
            renderers: Mutex::new(HashMap::new()),
            unsupported_logged: Mutex::new(std::collections::HashSet::new()),
            metrics: metrics.as_ref().and_then(Metrics::family),
        }
    }

    /// The renderer of `artifacts`, compiled on first use. A template that does not compile is
    /// `render_unavailable` for every request of the model until its artifacts change.
    fn renderer(&self, artifacts: &ModelArtifacts) -> Result<Arc<PromptRenderer>, KvUnavailable> {
        let mut renderers = self.renderers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = renderers.get(&artifacts.key) {
            return Ok(found.clone());
        }
        let template = match chat_template(artifacts) {
            Ok(template) => template.map(Arc::new),
            Err(error) => {
                warn!(%error, key = ?artifacts.key, "The pinned chat template does not compile; KV-aware selection scores without overlap for its models.");
                return Err(KvUnavailable::RenderUnavailable);
            }
        };
        let renderer = Arc::new(
            PromptRenderer::new(artifacts.tokenizer.clone(), template, self.limits)
                .with_permits(self.permits.clone()),
        );
        if renderers.len() >= MAX_RENDERERS {
            // A renderer is cheap to rebuild; dropping them all keeps the bound simple.
            renderers.clear();
        }
        renderers.insert(artifacts.key, renderer.clone());
        Ok(renderer)
    }

    fn unsupported(&self, model: &str, error: &PrepareError) {
        let mut logged = self
            .unsupported_logged
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if logged.contains(model) {
            return;
        }
        if logged.len() >= MAX_LOGGED_MODELS {
            logged.clear();
        }
        logged.insert(model.to_owned());
        if let Some(metrics) = &self.metrics {
            metrics.kv_artifact(KvArtifactResult::Unsupported);
        }
        warn!(model, %error, "The model's block sizes cannot be hashed; it scores without overlap.");
    }
}

/// The chat template a model renders with: the card's `chat_template_file` wins over the
/// `prompt_formatter`'s template (as upstream), with special tokens from `tokenizer_config.json`
/// when the formatter is one. `None`: the model has no template (completions still tokenize).
fn chat_template(artifacts: &ModelArtifacts) -> Result<Option<ChatTemplate>, String> {
    let special = match &artifacts.prompt_formatter {
        Some(PromptFormatterSource::TokenizerConfigJson(bytes)) => {
            serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(bytes)
                .map(|config| SpecialTokens::from_config(&config))
                .unwrap_or_default()
        }
        _ => SpecialTokens::default(),
    };
    let sources = [
        artifacts.chat_template_file.as_ref(),
        artifacts.prompt_formatter.as_ref(),
    ];
    let Some(source) = sources.into_iter().flatten().next() else {
        return Ok(None);
    };
    let template = match source {
        PromptFormatterSource::TokenizerConfigJson(bytes) => {
            ChatTemplate::from_tokenizer_config_json(bytes)
        }
        PromptFormatterSource::ChatTemplateJinja(bytes) => {
            let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
            ChatTemplate::from_jinja(text, special)
        }
        PromptFormatterSource::ChatTemplateJson(bytes) => {
            let value: serde_json::Value =
                serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
            let text = value
                .get("chat_template")
                .and_then(|t| t.as_str())
                .ok_or("chat_template.json holds no chat_template string")?;
            ChatTemplate::from_jinja(text, special)
        }
    };
    template.map(Some).map_err(|e| e.to_string())
}

/// `nvext.cache_salt` (Dynamo's field) or a top-level `cache_salt`, bounded.
fn cache_salt(body: &serde_json::Value) -> Option<&str> {
    body.get("nvext")
        .and_then(|n| n.get("cache_salt"))
        .or_else(|| body.get("cache_salt"))
        .and_then(|s| s.as_str())
        .filter(|s| s.len() <= 1024)
}

impl KvPromptPrep for ArtifactPromptPrep {
    fn prepare<'a>(
        &'a self,
        request: KvPrepRequest<'a>,
    ) -> BoxFuture<'a, Result<PreparedPrompt, KvUnavailable>> {
        Box::pin(async move {
            let artifacts =
                self.artifacts
                    .artifacts_for_model(request.model)
                    .map_err(|unavailable| match unavailable {
                        ArtifactUnavailable::Fleet(u)
                            if u.selection_label() == "artifact_unpinned" =>
                        {
                            KvUnavailable::ArtifactUnpinned
                        }
                        _ => KvUnavailable::TokenizerUnavailable,
                    })?;
            let renderer = self.renderer(&artifacts)?;
            let sizes: Vec<u32> = request.block_sizes.iter().map(|b| b.get()).collect();
            match renderer
                .prepare(request.body, &sizes, None, cache_salt(request.body))
                .await
            {
                Ok(prepared) => Ok(prepared),
                Err(error) => Err(match error.kind() {
                    PrepareFailureKind::PromptTooLarge => KvUnavailable::PromptTooLarge,
                    PrepareFailureKind::RenderUnavailable => KvUnavailable::RenderUnavailable,
                    PrepareFailureKind::Unsupported => {
                        self.unsupported(request.model, &error);
                        KvUnavailable::RenderUnavailable
                    }
                }),
            }
        })
    }
}
