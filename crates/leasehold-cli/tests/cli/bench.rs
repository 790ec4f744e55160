//! `leasehold bench` workloads run briefly, so that none rots.

use super::*;

#[test]
fn bench_e1_measures_each_hand_over_and_its_observation_on_memory_and_local() {
    let cli = Cli::new("bench-e1");
    let e1 = |rounds: &'static str, deaths: &'static str| {
        let args = [
            "bench",
            "--workload",
            "E1",
            "--workers",
            "3",
            "--ttl",
            "300ms",
        ];
        [&args[..], &["--rounds", rounds, "--deaths", deaths]].concat()
    };
    let args = [&e1("12", "2")[..], &["--json"]].concat();
    let mut memory = cli.bare(&[&["--store", "memory:"][..], &args].concat());
    let memory = Out::from(memory.output().unwrap());
    let local = cli.run(&args);
    for (store, out) in [("memory", memory), ("local", local)] {
        let line: Value = serde_json::from_str(out.expect(0).stdout.trim()).unwrap();
        assert_eq!(line["schema"], "leasehold.elect.v1");
        assert_eq!(line["backend"], store);
        assert_eq!(line["candidates"], 3);
        assert_eq!(line["errors"], 0, "{line}");
        let (resign, death) = (&line["resign"], &line["death"]);
        for (case, rounds) in [(resign, 12), (death, 2)] {
            assert_eq!(case["handovers"], rounds, "{line}");
            assert_eq!(case["observed"], rounds, "{line}");
            assert_eq!(case["overlaps"], 0, "{line}");
            assert_eq!(case["timeouts"], 0, "{line}");
            let (p50, max) = (&case["handover"]["p50_us"], &case["handover"]["max_us"]);
            assert!(p50.as_f64().unwrap() <= max.as_f64().unwrap(), "{line}");
        }
        // A death is handed over after the lease's end, which a resignation does not wait for.
        assert!(death["past_lease"]["max_us"].is_f64(), "{line}");
        assert!(resign["past_lease"]["max_us"].is_null(), "{line}");
    }

    let table = cli.run(&e1("2", "1")).expect(0).stdout;
    for row in [
        "resign: next leads",
        "death: observed",
        "past the lease's end",
    ] {
        assert!(table.contains(row), "no {row:?} in:\n{table}");
    }
    let out = cli.run(&["bench", "--workload", "E1", "--workers", "1"]);
    assert!(out.expect(64).stderr.contains("2 to 100 candidates"));
}

#[test]
fn bench_s1_serves_every_waiter_and_reports_their_memory_on_memory_and_local() {
    let cli = Cli::new("bench-s1");
    let args = [
        "bench",
        "--workload",
        "S1",
        "--names",
        "20",
        "--waiters",
        "5",
        "--json",
    ];
    let mut memory = cli.bare(&[&["--store", "memory:"][..], &args].concat());
    let memory = Out::from(memory.output().unwrap());
    let local = cli.run(&args);
    for (store, out) in [("memory", memory), ("local", local)] {
        let line: Value = serde_json::from_str(out.expect(0).stdout.trim()).unwrap();
        assert_eq!(line["schema"], "leasehold.scale.v1");
        assert_eq!(line["backend"], store);
        assert_eq!(line["waiters"], 100, "{line}");
        assert_eq!(line["served"], 100, "{line}");
        assert_eq!(line["errors"], 0, "{line}");
        assert_eq!(line["left_locks"], 0, "{line}");
        assert!(line["served_s"].is_f64(), "{line}");
        assert!(line["waiter_bytes"].is_u64(), "{line}");
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            let heap = line["waiter_heap_bytes"].as_u64().expect("a heap figure");
            assert!(heap > 0, "{line}");
        }
    }
}
