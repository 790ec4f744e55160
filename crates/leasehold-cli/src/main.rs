fn main() -> std::process::ExitCode {
    leasehold_cli::main()
}
