//! `qpip-nbd info`: an export's details as nbdinfo shows them (its `--json` keys), `--list`
//! of every export, `--map[=CONTEXT]` with `--totals`, `--size`, and the yes/no questions
//! (`--can`/`--is`/`--has FEATURE`, exit status 0 or 2, and their negations).

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use nbd_client::{Client, ClientOptions, ExportInfo, NbdUri};
use nbd_proto::flags::TransmissionFlags as TF;
use nbd_proto::peer_text::printable;
use qpip_cli::outln;

/// The context `--map` shows unless told another.
pub(crate) const BASE_ALLOCATION: &str = "base:allocation";

/// Bytes nbdinfo hands to file(1) for `content`.
const CONTENT_PROBE: u64 = 8192;

/// What `info` was asked for.
pub(crate) struct InfoArgs {
    pub uri: String,
    pub json: bool,
    pub size: bool,
    pub list: bool,
    /// `--content`/`--no-content`; `None`: nbdinfo's default (probe unless `--list`).
    pub content: Option<bool>,
    pub map: Option<String>,
    pub totals: bool,
    /// `--can/--is/--has FEATURE` (`false`) or `--cannot/--isnt/--hasnt FEATURE` (`true`).
    pub question: Option<(String, bool)>,
}

/// Runs `info`; the exit status (2: a question answered no).
pub(crate) fn run(a: &InfoArgs, base: &ClientOptions) -> Result<i32> {
    if let Some((feature, negated)) = &a.question {
        let f = Feature::parse(feature)?;
        let info = query(&a.uri, base)?;
        let yes = f.answer(&a.uri, &info, base)? != *negated;
        return Ok(if yes { 0 } else { 2 });
    }
    if let Some(ctx) = &a.map {
        let map = read_map(&a.uri, base, ctx)?;
        if a.totals {
            print_totals(&map, ctx, a.json)?;
        } else {
            print_map(&map, ctx, a.json)?;
        }
        return Ok(0);
    }
    if a.size {
        outln!("{}", query(&a.uri, base)?.size)?;
        return Ok(0);
    }
    let content = a.content.unwrap_or(!a.list);
    let exports = if a.list {
        let list = Client::list_with(&a.uri, base)
            .map_err(|e| in_context(e, "listing exports of", &a.uri))?;
        let mut parsed = NbdUri::parse(&a.uri)?;
        let mut v = Vec::new();
        for e in list {
            parsed.export = e.name.clone();
            let mut d = details(&parsed.to_string(), base, content)?;
            if d.description.as_deref().is_none_or(str::is_empty) && !e.description.is_empty() {
                d.description = Some(e.description);
            }
            v.push(d);
        }
        v
    } else {
        vec![details(&a.uri, base, content)?]
    };
    let tls = NbdUri::parse(&a.uri)?.tls.is_some();
    let structured = exports.first().is_none_or(|d| d.structured);
    if a.json {
        // nbdinfo's own layout, byte for byte: one key a line, the exports' keys indented by
        // a tab, in its order.
        let mut out = format!(
            "{{\n\"protocol\": \"newstyle-fixed\",\n\"TLS\": {tls},\n\"structured\": {structured},\n"
        );
        let objects: Vec<String> = exports.iter().map(Details::json).collect();
        if objects.is_empty() {
            out.push_str("\"exports\": [ ]\n");
        } else {
            out.push_str(&format!("\"exports\": [\n{} ]\n", objects.join(",\n")));
        }
        out.push('}');
        outln!("{out}")?;
    } else {
        outln!(
            "protocol: newstyle-fixed {} TLS{}",
            if tls { "with" } else { "without" },
            if structured {
                ", using structured packets"
            } else {
                ""
            }
        )?;
        // One export after another, no blank line between them (as nbdinfo --list).
        for d in &exports {
            d.print_text()?;
        }
    }
    Ok(0)
}

/// NBD_OPT_INFO for the export `uri` names; an unknown export in one line naming those
/// there are (as `copy` words it).
pub(crate) fn query(uri: &str, base: &ClientOptions) -> Result<ExportInfo> {
    Client::info_with(uri, base).map_err(|e| unknown_export(uri, e, base, "querying"))
}

/// The error of a failed connection to `uri`: the server's export list when it refused the
/// name, else the error with "`doing` URI" as context (see [`in_context`]).
pub(crate) fn unknown_export(
    uri: &str,
    e: nbd_client::Error,
    base: &ClientOptions,
    doing: &str,
) -> anyhow::Error {
    match Client::explain_unknown_export(uri, &e, base) {
        Some(line) => anyhow::anyhow!(line),
        None => in_context(e, doing, uri),
    }
}

/// `e` with "`doing` URI" as context, unless `e` names the URI itself ("cannot connect to
/// URI: ..."): the message says the URI once.
pub(crate) fn in_context(e: nbd_client::Error, doing: &str, uri: &str) -> anyhow::Error {
    let e = anyhow::Error::new(e);
    if names_uri(&e) {
        e
    } else {
        e.context(format!("{doing} {uri}"))
    }
}

/// `e` is a client error whose message names the server's URI (a failed connection or
/// handshake, a lost connection, a broken protocol).
pub(crate) fn names_uri(e: &anyhow::Error) -> bool {
    use nbd_client::Error as E;
    matches!(
        e.downcast_ref::<E>(),
        Some(
            E::Connect { .. }
                | E::Handshake { .. }
                | E::HandshakeIo { .. }
                | E::Tls { .. }
                | E::ConnectionLost { .. }
                | E::Protocol { .. }
                | E::ExportChanged { .. }
        )
    )
}

fn connect_one(uri: &str, base: &ClientOptions) -> Result<Client> {
    Client::connect_with(
        uri,
        ClientOptions {
            window: 1,
            ..base.clone()
        },
    )
    .map_err(|e| unknown_export(uri, e, base, "connecting to"))
}

/// What the features of `--can`, `--is` and `--has` are (nbdinfo's names and their
/// spellings with `_` or without a separator).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Feature {
    Connect,
    Read,
    Write,
    ReadOnly,
    Rotational,
    Tls,
    StructuredReply,
    ExtendedHeaders,
    Flush,
    Fua,
    Trim,
    Zero,
    FastZero,
    Df,
    MultiConn,
    Cache,
    /// Block status: `base:allocation` (our `extents`).
    Extents,
}

/// Every feature by its canonical name (listed in an error for an unknown one).
const FEATURES: &[(&str, Feature)] = &[
    ("connect", Feature::Connect),
    ("read", Feature::Read),
    ("write", Feature::Write),
    ("read-only", Feature::ReadOnly),
    ("rotational", Feature::Rotational),
    ("tls", Feature::Tls),
    ("structured-reply", Feature::StructuredReply),
    ("extended-headers", Feature::ExtendedHeaders),
    ("flush", Feature::Flush),
    ("fua", Feature::Fua),
    ("trim", Feature::Trim),
    ("zero", Feature::Zero),
    ("fast-zero", Feature::FastZero),
    ("df", Feature::Df),
    ("multi-conn", Feature::MultiConn),
    ("cache", Feature::Cache),
    ("base:allocation", Feature::Extents),
    ("extents", Feature::Extents),
];

impl Feature {
    fn parse(s: &str) -> Result<Feature> {
        let norm = |x: &str| {
            x.to_ascii_lowercase()
                .chars()
                .filter(|c| !matches!(c, '-' | '_' | ' '))
                .collect::<String>()
        };
        let want = norm(s);
        let extra: &[(&str, Feature)] = &[
            ("sr", Feature::StructuredReply),
            ("structured", Feature::StructuredReply),
            ("structuredreplies", Feature::StructuredReply),
            ("extendedheader", Feature::ExtendedHeaders),
            ("writezeroes", Feature::Zero),
            ("blockstatus", Feature::Extents),
        ];
        FEATURES
            .iter()
            .chain(extra)
            .find(|(n, _)| norm(n) == want)
            .map(|(_, f)| *f)
            .with_context(|| {
                format!(
                    "unknown --can/--is/--has feature {s:?}; known: {}",
                    FEATURES
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
    }

    /// True or false by the export's flags or, for what the transmission phase decides, a
    /// connection.
    fn answer(self, uri: &str, info: &ExportInfo, base: &ClientOptions) -> Result<bool> {
        let f = info.flags;
        let on_connection = |q: fn(&Client) -> bool| -> Result<bool> {
            let c = connect_one(uri, base)?;
            let yes = q(&c);
            c.disconnect().ok();
            Ok(yes)
        };
        Ok(match self {
            Feature::Connect | Feature::Read => true,
            Feature::Write => !f.contains(TF::READ_ONLY),
            Feature::ReadOnly => f.contains(TF::READ_ONLY),
            Feature::Rotational => f.contains(TF::ROTATIONAL),
            // A TLS URI connects over TLS or not at all.
            Feature::Tls => NbdUri::parse(uri)?.tls.is_some(),
            Feature::Flush => f.contains(TF::SEND_FLUSH),
            Feature::Fua => f.contains(TF::SEND_FUA),
            Feature::Trim => f.contains(TF::SEND_TRIM),
            Feature::Zero => f.contains(TF::SEND_WRITE_ZEROES),
            Feature::FastZero => f.contains(TF::SEND_FAST_ZERO),
            // Only a server's reply to NBD_OPT_GO after structured replies carries
            // SEND_DF (NBD_OPT_INFO's flags lack it), as libnbd's can_df reads it.
            Feature::Df => on_connection(|c| c.flags().contains(TF::SEND_DF))?,
            Feature::MultiConn => f.contains(TF::CAN_MULTI_CONN),
            Feature::Cache => f.contains(TF::SEND_CACHE),
            Feature::StructuredReply => on_connection(Client::structured_replies)?,
            Feature::ExtendedHeaders => on_connection(Client::extended_headers)?,
            Feature::Extents => on_connection(Client::can_block_status)?,
        })
    }
}

/// One export as nbdinfo describes it.
struct Details {
    uri: String,
    name: String,
    description: Option<String>,
    content: Option<String>,
    info: ExportInfo,
    structured: bool,
    contexts: Vec<String>,
}

fn details(uri: &str, base: &ClientOptions, probe: bool) -> Result<Details> {
    let mut info = query(uri, base)?;
    let listing = ClientOptions {
        list_contexts: true,
        ..base.clone()
    };
    let mut c = connect_one(uri, &listing)?;
    // The flags of the connection, which negotiated structured replies: SEND_DF is sent
    // only then (NBD_OPT_INFO precedes that negotiation), and libnbd's can_df reads these.
    info.flags = c.flags();
    let structured = c.structured_replies();
    // The contexts the server listed (NBD_OPT_LIST_META_CONTEXT), as nbdinfo shows them; a
    // server that lists none but selected base:allocation has that one.
    let mut contexts = c.listed_contexts().to_vec();
    if contexts.is_empty() && c.can_block_status() {
        contexts.push(BASE_ALLOCATION.to_owned());
    }
    let content = if probe {
        let n = CONTENT_PROBE.min(info.size) as usize;
        let mut head = vec![0u8; n];
        if n > 0 {
            c.read_at(0, &mut head)
                .with_context(|| format!("reading the start of {uri}"))?;
        }
        file_type(&head)
    } else {
        None
    };
    c.disconnect().ok();
    let parsed = NbdUri::parse(uri)?;
    Ok(Details {
        uri: parsed.to_string(),
        name: info.name.clone().unwrap_or(parsed.export),
        description: info.description.clone(),
        content,
        info,
        structured,
        contexts,
    })
}

/// What file(1) says of `head`, as nbdinfo's `content`; `None` without file(1) (nbdinfo then
/// leaves the key out too).
fn file_type(head: &[u8]) -> Option<String> {
    let mut child = Command::new("file")
        .args(["-b", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // file(1) may stop reading early: a broken pipe is no failure.
    let _ = child.stdin.take()?.write_all(head);
    let out = child.wait_with_output().ok()?;
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .to_string();
    (out.status.success() && !line.is_empty()).then_some(line)
}

/// nbdinfo's `export-size-str`: the largest unit that divides the size exactly.
fn size_str(mut n: u64) -> String {
    let units = ["", "K", "M", "G", "T", "P", "E"];
    let mut i = 0;
    while n != 0 && n.is_multiple_of(1024) && i + 1 < units.len() {
        n /= 1024;
        i += 1;
    }
    format!("{n}{}", units[i])
}

impl Details {
    fn bools(&self) -> [(&'static str, bool); 10] {
        let f = self.info.flags;
        [
            ("is_rotational", f.contains(TF::ROTATIONAL)),
            ("is_read_only", f.contains(TF::READ_ONLY)),
            ("can_cache", f.contains(TF::SEND_CACHE)),
            ("can_df", f.contains(TF::SEND_DF)),
            ("can_fast_zero", f.contains(TF::SEND_FAST_ZERO)),
            ("can_flush", f.contains(TF::SEND_FLUSH)),
            ("can_fua", f.contains(TF::SEND_FUA)),
            ("can_multi_conn", f.contains(TF::CAN_MULTI_CONN)),
            ("can_trim", f.contains(TF::SEND_TRIM)),
            ("can_zero", f.contains(TF::SEND_WRITE_ZEROES)),
        ]
    }

    /// The export's JSON object as nbdinfo prints it, from "\t{" to "\t}" (no newline).
    fn json(&self) -> String {
        let mut lines = vec![format!("\"export-name\": {}", json_str(&self.name))];
        if let Some(d) = self.description.as_deref().filter(|d| !d.is_empty()) {
            lines.push(format!("\"description\": {}", json_str(d)));
        }
        if let Some(c) = &self.content {
            lines.push(format!("\"content\": {}", json_str(c)));
        }
        lines.push(format!("\"uri\": {}", json_str(&self.uri)));
        let contexts: Vec<String> = self
            .contexts
            .iter()
            .map(|c| format!("\t\t{}", json_str(c)))
            .collect();
        lines.push(format!("\"contexts\": [\n{}\n\t]", contexts.join(",\n")));
        for (k, v) in self.bools() {
            lines.push(format!("\"{k}\": {v}"));
        }
        let bs = self.info.block_size;
        lines.push(format!("\"block_size_minimum\": {}", bs.min));
        lines.push(format!("\"block_size_preferred\": {}", bs.preferred));
        lines.push(format!("\"block_size_maximum\": {}", bs.max));
        lines.push(format!("\"export-size\": {}", self.info.size));
        lines.push(format!(
            "\"export-size-str\": {}",
            json_str(&size_str(self.info.size))
        ));
        format!("\t{{\n\t{}\n\t}}", lines.join(",\n\t"))
    }

    fn print_text(&self) -> Result<()> {
        // Text from the server: escaped before it reaches the terminal.
        outln!("export=\"{}\":", printable(self.name.as_bytes()))?;
        if let Some(d) = self.description.as_deref().filter(|d| !d.is_empty()) {
            outln!("\tdescription: {}", printable(d.as_bytes()))?;
        }
        // nbdinfo adds the short form only where it has a unit (not for 0 or 1000).
        let size = self.info.size;
        match size_str(size) {
            short if short != size.to_string() => outln!("\texport-size: {size} ({short})")?,
            _ => outln!("\texport-size: {size}")?,
        }
        if let Some(c) = &self.content {
            outln!("\tcontent: {c}")?;
        }
        outln!("\turi: {}", self.uri)?;
        if !self.contexts.is_empty() {
            outln!("\tcontexts:")?;
            for c in &self.contexts {
                outln!("\t\t{c}")?;
            }
        }
        for (k, v) in self.bools() {
            outln!("\t{k}: {v}")?;
        }
        let bs = self.info.block_size;
        outln!("\tblock_size_minimum: {}", bs.min)?;
        outln!("\tblock_size_preferred: {}", bs.preferred)?;
        outln!("\tblock_size_maximum: {}", bs.max)?;
        Ok(())
    }
}

/// The whole export's extents in the context `ctx` (offset, length, type), adjacent ones of
/// one type merged.
fn read_map(uri: &str, base: &ClientOptions, ctx: &str) -> Result<Vec<(u64, u64, u32)>> {
    // Only the context asked for, as nbdinfo asks.
    let opts = ClientOptions {
        base_allocation: ctx == BASE_ALLOCATION,
        meta_contexts: if ctx == BASE_ALLOCATION {
            Vec::new()
        } else {
            vec![ctx.to_owned()]
        },
        ..base.clone()
    };
    let mut c = connect_one(uri, &opts)?;
    if !c.contexts().iter().any(|(_, n)| n == ctx) {
        bail!(
            "{uri}: the server offers no block status in the {} context",
            printable(ctx.as_bytes())
        );
    }
    let size = c.size();
    let mut map: Vec<(u64, u64, u32)> = Vec::new();
    let mut pos = 0;
    while pos < size {
        let ext = c
            .block_status_of(ctx, pos, size - pos)
            .with_context(|| format!("{uri}: block status at {pos}"))?;
        let mut advanced = false;
        let from = pos;
        for e in ext
            .iter()
            .filter(|e| e.offset >= from && e.offset < size && e.length > 0)
        {
            let len = e.length.min(size - e.offset);
            match map.last_mut() {
                Some((o, l, t)) if *t == e.flags && *o + *l == e.offset => *l += len,
                _ => map.push((e.offset, len, e.flags)),
            }
            pos = e.offset + len;
            advanced = true;
        }
        if !advanced {
            bail!("{uri}: block status at {pos} described nothing");
        }
    }
    c.disconnect().ok();
    Ok(map)
}

/// What nbdinfo calls a type `t` of the context `ctx`; None where it names none (the
/// description is then left out, as nbdinfo leaves it out).
fn describe(ctx: &str, t: u32) -> Option<String> {
    let name = |names: &[&str]| names.get(t as usize).map(|n| n.to_string());
    if ctx == BASE_ALLOCATION {
        name(&["data", "hole", "zero", "hole,zero"])
    } else if ctx.starts_with("qemu:dirty-bitmap:") {
        name(&["clean", "dirty"])
    } else if ctx == "qemu:allocation-depth" {
        Some(match t {
            0 => "absent".to_owned(),
            1 => "local".to_owned(),
            n => format!("backing depth {n}"),
        })
    } else {
        None
    }
}

/// One line of `--map --json` or `--map --totals --json` as nbdinfo prints it: `fields`
/// (already `"key": value`), then the description where there is one, then `close`.
fn json_line(fields: &str, ctx: &str, t: u32, close: &str) -> String {
    match describe(ctx, t) {
        Some(d) => format!("{{ {fields}, \"description\": {}{close}", json_str(&d)),
        None => format!("{{ {fields}{close}"),
    }
}

/// `s` as a JSON string, escaped as nbdinfo escapes it: `"` and `\\` with a backslash,
/// control characters as `\u00XX`.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' | '\\' => {
                out.push('\\');
                out.push(ch);
            }
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `text` followed by "  DESCRIPTION" where there is one, as nbdinfo prints a line.
fn line(text: String, sep: &str, ctx: &str, t: u32) -> Result<()> {
    match describe(ctx, t) {
        Some(d) => outln!("{text}{sep}{d}"),
        None => outln!("{text}"),
    }
}

fn print_map(map: &[(u64, u64, u32)], ctx: &str, json: bool) -> Result<()> {
    if json {
        // nbdinfo's own layout, one extent a line: "[", the lines joined by ",", "]" (an
        // empty map leaves an empty line between them).
        let lines: Vec<_> = map
            .iter()
            .map(|(o, l, t)| {
                let f = format!("\"offset\": {o}, \"length\": {l}, \"type\": {t}");
                json_line(&f, ctx, *t, "}")
            })
            .collect();
        outln!("[\n{}\n]", lines.join(",\n"))?;
    } else {
        for (o, l, t) in map {
            // nbdinfo's "%10" PRIu64 "  %10" PRIu64 "  %3" PRIu32 ["  %s"].
            line(format!("{o:>10}  {l:>10}  {t:>3}"), "  ", ctx, *t)?;
        }
    }
    Ok(())
}

/// `--map --totals`: bytes and share of the export per type, by type.
fn print_totals(map: &[(u64, u64, u32)], ctx: &str, json: bool) -> Result<()> {
    let size: u64 = map.iter().map(|(_, l, _)| l).sum();
    let mut by_type = std::collections::BTreeMap::<u32, u64>::new();
    for (_, l, t) in map {
        *by_type.entry(*t).or_default() += l;
    }
    let rows: Vec<(u64, f64, u32)> = by_type
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(t, n)| (n, 100.0 * n as f64 / size.max(1) as f64, t))
        .collect();
    if json {
        // nbdinfo's layout as for the map, the percentage as printf's %g; "[]" when empty.
        let lines: Vec<_> = rows
            .iter()
            .map(|(n, p, t)| {
                let f = format!(
                    "\"size\": {n}, \"percent\": {}, \"type\": {t}",
                    printf_g(*p)
                );
                json_line(&f, ctx, *t, " }")
            })
            .collect();
        if lines.is_empty() {
            outln!("[]")?;
        } else {
            outln!("[\n{}\n]", lines.join(",\n"))?;
        }
    } else {
        for (n, p, t) in rows {
            // nbdinfo's "%10" PRIu64 " %5.1f%% %3" PRIu32 [" %s"].
            line(format!("{n:>10} {p:5.1}% {t:>3}"), " ", ctx, t)?;
        }
    }
    Ok(())
}

/// `x` as C's printf "%g" writes it: 6 significant digits, trailing zeros dropped,
/// exponent form below 1e-4 and from 1e6.
fn printf_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let sci = format!("{x:.5e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let trim = |s: &str| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s.to_owned()
        }
    };
    if (-4..6).contains(&exp) {
        trim(&format!("{x:.*}", (5 - exp) as usize))
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa), exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_features_as_nbdinfo_spells_them() {
        assert_eq!(size_str(4 << 20), "4M");
        assert_eq!(size_str(2125119488), "2075312K");
        assert_eq!(size_str(1000), "1000");
        assert_eq!(size_str(0), "0");
        assert_eq!(Feature::parse("Fast_Zero").unwrap(), Feature::FastZero);
        assert_eq!(Feature::parse("multiconn").unwrap(), Feature::MultiConn);
        assert_eq!(Feature::parse("base:allocation").unwrap(), Feature::Extents);
        assert_eq!(
            Feature::parse("structured reply").unwrap(),
            Feature::StructuredReply
        );
        assert!(Feature::parse("teleport").is_err());
    }

    #[test]
    fn json_strings_escaped_as_nbdinfo() {
        assert_eq!(
            json_str("a\"b\\c\td\u{1}é"),
            "\"a\\\"b\\\\c\\u0009d\\u0001é\""
        );
    }

    #[test]
    fn percentages_as_printf_g() {
        for (x, g) in [
            (100.0, "100"),
            (33.333_333_333, "33.3333"),
            (66.666_666_667, "66.6667"),
            (1.5625, "1.5625"),
            (98.4375, "98.4375"),
            (0.000_123_456_7, "0.000123457"),
            (0.000_058_207_66, "5.82077e-05"),
            (99.999_999_9, "100"),
            (1e-9, "1e-09"),
        ] {
            assert_eq!(printf_g(x), g, "{x}");
        }
    }
}
