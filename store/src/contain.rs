//! The one place where a panic inside the storage crate is contained.
//!
//! sled 0.34 panics on some damaged files (`tried to serialize Uninitialized` while opening a
//! database whose pages were overwritten, for one). A cache must never take a build down, so
//! every call into sled from [`crate::LocalCache`] goes through [`contain`]: a panic there
//! becomes an error the store treats as a damaged database. The panic message is not printed
//! (the store warns in its own words), while panics anywhere else still print as usual.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

thread_local! {
    /// How deep this thread is inside [`contain`].
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

static HOOK: Once = Once::new();

/// Installs, once, a panic hook that stays silent for contained panics and defers to the
/// previous hook for all others.
fn install_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if DEPTH.with(Cell::get) == 0 {
                previous(info);
            }
        }));
    });
}

/// Runs `f`; a panic inside it comes back as `Err` with the panic's message.
///
/// Whatever `f` touched must be treated as broken afterwards: the store drops the database
/// handle it was using and never calls into it again.
pub(crate) fn contain<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install_hook();
    DEPTH.with(|d| d.set(d.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    DEPTH.with(|d| d.set(d.get() - 1));
    result.map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message_and_the_thread_goes_on() {
        assert_eq!(contain(|| 7), Ok(7));
        let e = contain(|| -> u32 { panic!("tried to serialize {}", "Uninitialized") });
        assert_eq!(e, Err("tried to serialize Uninitialized".to_string()));
        let nested = contain(|| contain(|| -> () { panic!("inner") }).is_err());
        assert_eq!(nested, Ok(true));
    }
}
