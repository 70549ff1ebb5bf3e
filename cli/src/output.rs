//! Standard output and standard error that tolerate a reader that went away
//! (`autopar ... | head`, `autopar build 2>&1 | head`): the command finishes its work and the
//! rest of its output is dropped, instead of a panic (`println!` and `eprintln!` panic on a
//! closed pipe; a panic inside the store's boundary would read as a damaged database).

use std::io::Write;

/// Writes formatted text to standard output; a closed pipe or another write error drops it.
pub fn write(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(args);
}

/// Writes formatted text to standard error; a closed pipe or another write error drops it.
pub fn write_err(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args);
}

/// `print!` that survives a closed pipe.
macro_rules! out {
    ($($t:tt)*) => { $crate::output::write(format_args!($($t)*)) };
}

/// `println!` that survives a closed pipe.
macro_rules! outln {
    () => { $crate::output::write(format_args!("\n")) };
    ($($t:tt)*) => {{
        $crate::output::write(format_args!($($t)*));
        $crate::output::write(format_args!("\n"));
    }};
}

/// `eprint!` that survives a closed pipe.
macro_rules! err {
    ($($t:tt)*) => { $crate::output::write_err(format_args!($($t)*)) };
}

/// `eprintln!` that survives a closed pipe.
macro_rules! errln {
    ($($t:tt)*) => {{
        $crate::output::write_err(format_args!($($t)*));
        $crate::output::write_err(format_args!("\n"));
    }};
}

pub(crate) use {err, errln, out, outln};
