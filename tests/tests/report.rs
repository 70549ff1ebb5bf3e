//! `autopar report` and `build --report`: one self-contained HTML page per plan, its charts
//! well-formed SVG, rendered by a real headless Chromium without errors and not blank.

use autopar_tests::TempWorkspace;
use std::path::Path;
use std::process::Command;

/// Every `<svg ...>...</svg>` element of `html`.
fn svgs(html: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = html;
    while let Some(start) = rest.find("<svg") {
        let end = rest[start..].find("</svg>").expect("a closed svg") + start + "</svg>".len();
        out.push(&rest[start..end]);
        rest = &rest[end..];
    }
    out
}

#[test]
fn build_report_writes_a_self_contained_page_per_target() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["build", "tiny-llama", "llama3-8b-128k", "--report"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("report    plans/tiny-llama.html"),
        "{}",
        r.stdout
    );
    for target in ["tiny-llama", "llama3-8b-128k"] {
        let html = ws.read(&format!("plans/{target}.html"));
        for section in [
            "<h2>Step time</h2>",
            "<h2>Memory per device, by stage</h2>",
            "<h2>Pipeline schedule</h2>",
            "<h2>Layouts searched</h2>",
            "<h2>Layers per stage</h2>",
            "<h2>What the last build recomputed</h2>",
        ] {
            assert!(html.contains(section), "{target}: no {section}");
        }
        // Nothing fetched from anywhere: no scripts, style sheets, images or links; the only
        // address is the SVG namespace.
        for banned in ["<script", "<link", "<img", "src=", "href=", "url("] {
            assert!(!html.contains(banned), "{target}: {banned}");
        }
        assert_eq!(
            html.matches("http").count(),
            html.matches("xmlns=\"http://www.w3.org/2000/svg\"").count(),
            "{target}: an address other than the SVG namespace"
        );
        // Every chart parses as XML, with the shapes its data asks for.
        let charts = svgs(&html);
        assert_eq!(charts.len(), 4, "{target}");
        for svg in &charts {
            let doc =
                roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("{target}: {e}\n{svg}"));
            assert_eq!(doc.root_element().tag_name().name(), "svg");
            assert!(doc.descendants().count() > 3, "{target}: an empty chart");
        }
        let plan: serde_json::Value =
            serde_json::from_str(&ws.read(&format!("plans/{target}.json"))).expect("plan");
        let points = plan["searched"].as_array().expect("searched points").len();
        assert_eq!(
            points as u64,
            plan["search"]["valid"].as_u64().expect("valid"),
            "{target}: one point per layout that can run"
        );
        let circles = roxmltree::Document::parse(charts[3])
            .expect("scatter")
            .descendants()
            .filter(|n| n.has_tag_name("circle"))
            .count();
        let alternatives = plan["alternatives"].as_array().expect("alternatives").len();
        assert_eq!(circles, points + alternatives + 1, "{target}");
    }
    // The long-sequence plan names its context parallelism.
    assert!(ws.read("plans/llama3-8b-128k.html").contains("cp 8 (p2p)"));
}

#[test]
fn report_writes_where_asked_and_refuses_unknown_targets() {
    let ws = TempWorkspace::default_copy();
    let none = ws.run(&["report", "tiny-llama"]);
    assert_eq!(none.code, 1, "no plan yet: {}", none.stderr);
    assert!(
        none.stderr.contains("autopar build tiny-llama"),
        "{}",
        none.stderr
    );
    assert_eq!(ws.run(&["build", "tiny-llama"]).code, 0);
    let r = ws.run(&["report", "tiny-llama", "-o", "page.html"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(ws.read("page.html").starts_with("<!DOCTYPE html>"));
    let bad = ws.run(&["report", "nope"]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(
        bad.stderr
            .contains("target `nope` is not known: expected one of"),
        "{}",
        bad.stderr
    );
}

/// Chromium from Debian's `chromium` package, which `.ci/run` installs.
fn chromium() -> Option<&'static str> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

#[test]
fn a_real_browser_renders_the_report_without_errors() {
    let Some(browser) = chromium() else {
        eprintln!(
            "skipped: no Chromium at /usr/bin/chromium (Debian's `chromium` package; .ci/run \
             installs it)"
        );
        return;
    };
    let ws = TempWorkspace::default_copy();
    assert_eq!(ws.run(&["build", "tiny-llama-3d", "--report"]).code, 0);
    let page = ws.path().join("plans/tiny-llama-3d.html");
    let shot = ws.path().join("shot.png");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1040,1600",
        ])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The page runs no script; a console message would be an error of the page itself.
    assert!(!stderr.contains(":CONSOLE"), "console output:\n{stderr}");
    let file = std::fs::File::open(&shot).expect("a screenshot");
    let mut reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("a buffer size")];
    let info = reader.next_frame(&mut buf).expect("a frame");
    let px = info.color_type.samples();
    let pixels = &buf[..info.buffer_size()];
    let inked = pixels
        .chunks(px)
        .filter(|p| p.iter().take(3).any(|&c| c < 200))
        .count();
    let share = inked as f64 / (pixels.len() / px) as f64;
    assert!(
        share > 0.02,
        "the page looks blank: {share:.4} of its pixels inked"
    );
}
