//! The sidecar's configuration as the harness writes it: built from the sidecar's own types
//! (`kvroute_sidecar::config`), so a field it does not know fails here and not in a sidecar that
//! will not start, and written as the TOML it reads, with a test's extra TOML merged over it.

use anyhow::{Context as _, Result};
use kvroute_sidecar::config::Config;

/// A value of one of the sidecar's configuration types from JSON: the fields given, every other
/// at its default, refused (by the sidecar's own `deny_unknown_fields`) when a field is not one.
pub fn typed<T: serde::de::DeserializeOwned>(what: &str, value: serde_json::Value) -> Result<T> {
    serde_json::from_value(value).with_context(|| format!("the harness's {what} configuration"))
}

/// `extra` (TOML text, `what` names it in errors) as a table.
pub fn table(what: &str, extra: &str) -> Result<toml::Table> {
    toml::from_str(extra).with_context(|| format!("{what} is not TOML: {extra}"))
}

/// `config` as the TOML the sidecar reads, with `extra` merged over it (a key given there
/// replaces the config's; an array of tables given there is appended to), parsed back as the
/// sidecar will: a key the merge got wrong fails here.
pub fn text(config: &Config, extra: toml::Table) -> Result<String> {
    let mut base = toml::Table::try_from(config).context("the sidecar's configuration as TOML")?;
    merge(&mut base, extra);
    let text = toml::to_string(&base)?;
    toml::from_str::<Config>(&text).context("the merged sidecar configuration")?;
    Ok(text)
}

/// `extra` over `base`: tables merged key by key, arrays appended, anything else replaced.
fn merge(base: &mut toml::Table, extra: toml::Table) {
    for (key, value) in extra {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(e)) => merge(b, e),
            (Some(toml::Value::Array(b)), toml::Value::Array(e)) => b.extend(e),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tables merge key by key, arrays of tables append, a plain key replaces.
    #[test]
    fn extra_merges_table_by_table() {
        let mut base = table("base", "a = 1\n[t]\nx = 1\ny = 2\n[[list]]\nn = 1\n").unwrap();
        merge(
            &mut base,
            table("extra", "a = 2\n[t]\ny = 3\n[[list]]\nn = 2\n").unwrap(),
        );
        assert_eq!(base["a"].as_integer(), Some(2));
        assert_eq!(base["t"]["x"].as_integer(), Some(1));
        assert_eq!(base["t"]["y"].as_integer(), Some(3));
        assert_eq!(base["list"].as_array().map(Vec::len), Some(2));
        assert!(table("extra", "not toml = = 1").is_err());
    }
}
