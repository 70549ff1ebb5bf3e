//! `autopar validate RUNS`: predictions against measured runs.

use super::print_json;
use crate::Failure;
use crate::args::ValidateArgs;
use crate::output::out;
use crate::render;
use autopar_engine::session::Session;
use autopar_engine::{runs, validate};

pub fn run(session: &Session, a: &ValidateArgs) -> Result<(), Failure> {
    let measured = runs::load(&a.runs)?;
    let v = validate::validate(session, &a.runs, &measured)?;
    if a.json {
        print_json(&v)
    } else {
        out!("{}", render::validation(&a.runs, &v));
        Ok(())
    }
}
