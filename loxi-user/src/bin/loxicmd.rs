//! `loxicmd`: the CLI of the loxilb REST API. See `loxi_user::cli`.
fn main() {
    let cli = loxi_user::cli::args::Cli::parse_with_env();
    let code = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(loxi_user::cli::run(cli)),
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            1
        }
    };
    std::process::exit(code);
}
