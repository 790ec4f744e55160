// The unwinder (libgcc_eh) linked in, so that the dynamic loader need not load libgcc_s at
// every start, whose constructor probes the CPU (slow in a VM: each CPUID traps) and whose
// symbols it must bind: about 0.2-0.3 ms of each `leasehold run`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[link(name = "gcc_eh", kind = "static", modifiers = "+whole-archive")]
extern "C" {}

fn main() -> std::process::ExitCode {
    leasehold_cli::main()
}
