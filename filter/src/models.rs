//! The model bundles one VM has loaded, and which ones it still has to fetch.

use std::collections::HashMap;

use kvroute_prompt::Preprocessor;
use kvroute_protocol::bundle::{Catalog, ModelBundle};

/// A loaded bundle.
pub struct LoadedModel {
    /// The bundle version it was built from.
    pub version: String,
    /// Template, tokenizer and block size.
    pub preprocessor: Preprocessor,
}

/// Why a fetched bundle was not installed.
#[derive(Debug)]
pub enum InstallError {
    /// The body is not a bundle document.
    Json(serde_json::Error),
    /// The bundle does not load (unsupported tokenizer component, bad template).
    Load {
        /// The model named in the bundle.
        model: String,
        /// What failed.
        error: kvroute_prompt::BundleError,
    },
}

impl std::fmt::Display for InstallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InstallError::Json(e) => write!(f, "bundle is not valid JSON: {e}"),
            InstallError::Load { model, error } => write!(f, "bundle of model {model}: {error}"),
        }
    }
}

/// Bundles by model name, plus the versions that failed to load (not retried until they change).
#[derive(Default)]
pub struct ModelRegistry {
    loaded: HashMap<String, LoadedModel>,
    failed: HashMap<String, String>,
    /// LoRA adapter name → the model it is served on.
    adapters: HashMap<String, String>,
}

impl ModelRegistry {
    /// The loaded bundle of `model`, if any.
    pub fn get(&self, model: &str) -> Option<&LoadedModel> {
        self.loaded.get(model)
    }

    /// The bundle a request's `model` uses: its own, or — for a LoRA adapter served under its
    /// own name — its base model's, with the base model's name and the adapter.
    pub fn resolve<'a>(
        &'a self,
        model: &'a str,
    ) -> Option<(&'a str, &'a LoadedModel, Option<&'a str>)> {
        if let Some(loaded) = self.loaded.get(model) {
            return Some((model, loaded, None));
        }
        let base = self.adapters.get(model)?;
        Some((base.as_str(), self.loaded.get(base)?, Some(model)))
    }

    /// How many models are loaded.
    pub fn len(&self) -> usize {
        self.loaded.len()
    }

    /// Whether no model is loaded.
    pub fn is_empty(&self) -> bool {
        self.loaded.is_empty()
    }

    /// Apply a catalog: forget models it no longer lists; return the models to (re)fetch.
    pub fn reconcile(&mut self, catalog: &Catalog) -> Vec<String> {
        let listed: HashMap<&str, &str> = catalog
            .models
            .iter()
            .map(|e| (e.model.as_str(), e.version.as_str()))
            .collect();
        self.loaded.retain(|m, _| listed.contains_key(m.as_str()));
        self.adapters = catalog
            .models
            .iter()
            .flat_map(|e| e.adapters.iter().map(|a| (a.clone(), e.model.clone())))
            .collect();
        self.failed
            .retain(|m, v| listed.get(m.as_str()) == Some(&v.as_str()));
        catalog
            .models
            .iter()
            .filter(|e| {
                self.loaded.get(&e.model).map(|l| l.version.as_str()) != Some(e.version.as_str())
                    && !self.failed.contains_key(&e.model)
            })
            .map(|e| e.model.clone())
            .collect()
    }

    /// Build and install a fetched bundle with a token cache of `token_cache_bytes`; returns
    /// (model, version).
    pub fn install(
        &mut self,
        body: &[u8],
        token_cache_bytes: usize,
    ) -> Result<(String, String), InstallError> {
        let bundle: ModelBundle = serde_json::from_slice(body).map_err(InstallError::Json)?;
        match Preprocessor::from_bundle(&bundle) {
            Ok(preprocessor) => {
                let preprocessor = preprocessor.with_token_cache(&bundle, token_cache_bytes);
                self.failed.remove(&bundle.model);
                self.loaded.insert(
                    bundle.model.clone(),
                    LoadedModel {
                        version: bundle.version.clone(),
                        preprocessor,
                    },
                );
                Ok((bundle.model, bundle.version))
            }
            Err(error) => {
                self.failed.insert(bundle.model.clone(), bundle.version);
                Err(InstallError::Load {
                    model: bundle.model,
                    error,
                })
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvroute_protocol::bundle::CatalogEntry;

    pub(crate) fn tiny_bundle(block_size: u32) -> ModelBundle {
        let dir = kvroute_protocol::samples_dir().join("vllm/tiny-llama-tokenizer");
        kvroute_prompt::model_dir::load_bundle(&dir, "tiny", block_size).unwrap()
    }

    fn catalog(entries: &[(&str, &str)]) -> Catalog {
        Catalog {
            models: entries
                .iter()
                .map(|(m, v)| CatalogEntry {
                    model: m.to_string(),
                    version: v.to_string(),
                    adapters: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn fetches_new_and_changed_bundles_only() {
        let mut reg = ModelRegistry::default();
        let bundle = tiny_bundle(16);
        assert_eq!(
            reg.reconcile(&catalog(&[("tiny", &bundle.version)])),
            vec!["tiny"]
        );
        let (model, version) = reg
            .install(&serde_json::to_vec(&bundle).unwrap(), 1 << 20)
            .unwrap();
        assert_eq!(
            (model.as_str(), version.as_str()),
            ("tiny", bundle.version.as_str())
        );
        assert!(reg
            .reconcile(&catalog(&[("tiny", &bundle.version)]))
            .is_empty());
        assert_eq!(reg.reconcile(&catalog(&[("tiny", "v2")])), vec!["tiny"]);
        assert!(
            reg.get("tiny").is_some(),
            "the old version serves until the new one loads"
        );
        assert!(reg.reconcile(&catalog(&[])).is_empty());
        assert!(reg.is_empty());
    }

    #[test]
    fn broken_bundle_is_not_refetched_until_it_changes() {
        let mut reg = ModelRegistry::default();
        let mut bundle = tiny_bundle(16);
        bundle.tokenizer_json = "{\"model\": {\"type\": \"Nope\"}}".into();
        bundle.version = "broken".into();
        let err = reg
            .install(&serde_json::to_vec(&bundle).unwrap(), 1 << 20)
            .unwrap_err();
        assert!(err.to_string().contains("tiny"), "{err}");
        assert!(reg.reconcile(&catalog(&[("tiny", "broken")])).is_empty());
        assert_eq!(reg.reconcile(&catalog(&[("tiny", "fixed")])), vec!["tiny"]);
        assert!(matches!(
            reg.install(b"not json", 1 << 20),
            Err(InstallError::Json(_))
        ));
    }
}
