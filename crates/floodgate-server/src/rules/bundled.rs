//! The bundled example rules (`examples/config`), compiled into the
//! program: `serve` and `proxy` with no `--config` serve them from any
//! directory on any machine. Messages name them `<embedded>/FILE`.

/// `(file name, text)` of every file in `examples/config`.
pub const BUNDLED_RULES: &[(&str, &str)] = &[
    ("api.yaml", include_str!("../../../../examples/config/api.yaml")),
    ("bench.yaml", include_str!("../../../../examples/config/bench.yaml")),
    ("proxy.yaml", include_str!("../../../../examples/config/proxy.yaml")),
    ("signup.yaml", include_str!("../../../../examples/config/signup.yaml")),
    ("social.yaml", include_str!("../../../../examples/config/social.yaml")),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_file_is_bundled_and_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/config");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
            .collect();
        on_disk.sort();
        let bundled: Vec<&str> = BUNDLED_RULES.iter().map(|(n, _)| *n).collect();
        assert_eq!(on_disk, bundled, "add the new example file to BUNDLED_RULES");
        let opts = floodgate_core::rules::LoadOptions::default();
        let set = floodgate_core::rules::RuleSet::build(floodgate_core::rules::Sources::embedded(BUNDLED_RULES), &opts)
            .unwrap();
        assert!(set.domain("proxy").is_some_and(|d| d.rules().count() > 0));
    }
}
