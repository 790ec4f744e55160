//! The README says what the code's lists say: its exit codes are `exit::CODES` (with the
//! command's own statuses) and their `--json` kinds `exit::KINDS`, its store URLs
//! `leasehold::url::URL_FORMS`.

use leasehold::url::URL_FORMS;
use leasehold_cli::exit;

/// The rows (first two cells) of the table under the README heading `heading`.
fn readme_table(heading: &str) -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let readme = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let section = readme
        .split_once(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading:?} in the README"))
        .1;
    let rows = (section.lines())
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2); // the header and its rule
    rows.map(|row| {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").collect();
        assert_eq!(cells.len(), 2, "not two cells: {row}");
        (cells[0].trim().to_string(), cells[1].trim().to_string())
    })
    .collect()
}

#[test]
fn readme_exit_codes_are_the_ones_leasehold_exits_with() {
    let documented = readme_table("### Exit status");
    let codes: Vec<(String, String)> = (exit::rows().into_iter())
        .map(|(code, meaning)| (code, meaning.to_string()))
        .collect();
    assert_eq!(documented, codes);
    let help = exit::table();
    for (code, _) in &codes {
        assert!(
            help.contains(&format!("\n  {code} ")),
            "{code} not in:\n{help}"
        );
    }
}

#[test]
fn readme_names_the_json_kind_of_each_exit_code() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let readme = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let section = (readme.split_once("\n### JSON output\n"))
        .expect("no JSON output section in the README")
        .1;
    let text = section
        .split("\n#")
        .next()
        .unwrap_or_default()
        .replace('\n', " ");
    for (code, kind) in exit::KINDS {
        let named = format!("`{kind}` ({code}");
        assert!(text.contains(&named), "the README does not say {named})");
    }
}

#[test]
fn readme_store_urls_are_the_forms_the_library_reads() {
    let documented = readme_table("### Store URLs");
    let forms: Vec<(String, String)> = URL_FORMS
        .iter()
        .map(|f| (format!("`{}`", f.form), f.store.to_string()))
        .collect();
    assert_eq!(documented, forms);
}
