//! Standard output that tolerates a reader that went away (`autopar ... | head`): the command
//! finishes its work and the rest of its output is dropped, instead of a panic.

use std::io::Write;

/// Writes formatted text to standard output; a closed pipe or another write error drops it.
pub fn write(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(args);
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

pub(crate) use {out, outln};
