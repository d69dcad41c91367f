//! Plain-text tables for the `status` commands: a header row and rows of
//! cells, columns padded to their widest cell, two spaces apart.

/// Renders `header` and `rows` as aligned text, one line each. Rows shorter
/// than the header are padded with empty cells.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().take(cols).enumerate() {
            if let Some(w) = width.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, w) in width.iter().enumerate() {
            let c = cells.get(i).copied().unwrap_or("");
            if i + 1 == cols {
                l.push_str(c);
            } else {
                l.push_str(c);
                l.extend(std::iter::repeat_n(' ', w - c.chars().count() + 2));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

/// Renders `rows` as aligned text without a header line (name and value
/// pairs).
pub fn render_rows(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let header = vec![""; cols];
    let all = render(&header, rows);
    // The header line of empty cells is an empty line.
    all.strip_prefix('\n').unwrap_or(&all).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_aligned() {
        let t = render(
            &["peer", "state"],
            &[
                vec!["acme/a".into(), "online".into()],
                vec!["acme/longer".into(), "offline".into()],
            ],
        );
        assert_eq!(
            t,
            "peer         state\nacme/a       online\nacme/longer  offline\n"
        );
    }

    #[test]
    fn rows_without_a_header_start_with_the_first_row() {
        let t = render_rows(&[
            vec!["relay".into(), "wss://r:1/".into()],
            vec!["relay id".into(), "r".into()],
        ]);
        assert_eq!(t, "relay     wss://r:1/\nrelay id  r\n");
    }
}
