//! The shell blocks of the project's own Markdown, for tests that run the
//! docs as a reader would (so a command that drifts from the code fails a
//! test instead of a new user).
//!
//! A block is a fenced code block (```` ``` ```` or `~~~`) whose info string
//! is `sh`, `bash` or `shell`, under a heading: from that heading to the
//! next heading of the same or a higher level. Fences indented inside a
//! list item are found too, and their lines lose the fence's indentation.
//!
//! Never: runs anything; it only reads text.

/// Why blocks could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocsError {
    /// No heading with this text.
    #[error("no heading {0:?} in the document")]
    NoHeading(String),
    /// A fence opened and never closed.
    #[error("a code block under {0:?} is never closed")]
    Unclosed(String),
}

/// One fenced block: its info string and its text (dedented, ending with a
/// newline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The info string after the fence (`sh`, `toml`, ...), trimmed.
    pub info: String,
    /// The block's lines.
    pub text: String,
}

impl Block {
    /// Whether this block is a shell block.
    pub fn is_shell(&self) -> bool {
        matches!(
            self.info.split_whitespace().next(),
            Some("sh" | "bash" | "shell")
        )
    }
}

/// The heading level and text of `line`, if it is an ATX heading.
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.bytes().take_while(|&b| b == b'#').count();
    if level == 0 || level > 6 {
        return None;
    }
    let rest = line.get(level..)?;
    rest.starts_with(' ')
        .then(|| (level, rest.trim().trim_end_matches('#').trim()))
}

/// Every fenced block under the heading whose text is `title` (exactly, as
/// written after the `#`s), in order.
pub fn blocks_under(markdown: &str, title: &str) -> Result<Vec<Block>, DocsError> {
    let mut lines = markdown.lines();
    let mut level = None;
    let mut fence: Option<(String, usize, String, String)> = None; // marker, indent, info, text
    let mut out = Vec::new();
    for line in lines.by_ref() {
        if let Some((l, t)) = heading(line)
            && t == title
        {
            level = Some(l);
            break;
        }
    }
    let Some(level) = level else {
        return Err(DocsError::NoHeading(title.into()));
    };
    for line in lines {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some((marker, fence_indent, info, text)) = &mut fence {
            if trimmed.starts_with(marker.as_str()) && trimmed.trim_end() == marker.as_str() {
                out.push(Block {
                    info: std::mem::take(info),
                    text: std::mem::take(text),
                });
                fence = None;
            } else {
                // Lines inside a list item's block carry its indentation.
                let cut = indent.min(*fence_indent);
                text.push_str(line.get(cut..).unwrap_or(""));
                text.push('\n');
            }
            continue;
        }
        if indent == 0
            && let Some((l, _)) = heading(line)
            && l <= level
        {
            break;
        }
        for marker in ["```", "~~~"] {
            if let Some(info) = trimmed.strip_prefix(marker) {
                let run = marker.len()
                    + info
                        .bytes()
                        .take_while(|&b| b == marker.as_bytes()[0])
                        .count();
                let full = marker.chars().next().unwrap_or('`').to_string().repeat(run);
                let info = trimmed.get(run..).unwrap_or("").trim().to_string();
                fence = Some((full, indent, info, String::new()));
                break;
            }
        }
    }
    if fence.is_some() {
        return Err(DocsError::Unclosed(title.into()));
    }
    Ok(out)
}

/// The shell blocks under `title`, in order.
pub fn shell_blocks(markdown: &str, title: &str) -> Result<Vec<String>, DocsError> {
    Ok(blocks_under(markdown, title)?
        .into_iter()
        .filter(Block::is_shell)
        .map(|b| b.text)
        .collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const DOC: &str = "# Title\n\
        \n\
        ## First\n\
        \n\
        ```sh\n\
        echo one\n\
        ```\n\
        \n\
        ```toml\n\
        a = 1\n\
        ```\n\
        \n\
        ### Nested\n\
        \n\
        1. A step:\n\
        \n\
        \x20\x20\x20```sh\n\
        \x20\x20\x20cat > f <<EOT\n\
        \x20\x20\x20[x]\n\
        \x20\x20\x20EOT\n\
        \x20\x20\x20```\n\
        \n\
        ## Second\n\
        \n\
        ```\n\
        # not a heading inside a block\n\
        ```\n\
        ```bash\n\
        echo two\n\
        ```\n";

    #[test]
    fn blocks_of_a_section_and_its_subsections_dedented() {
        assert_eq!(
            shell_blocks(DOC, "First").unwrap(),
            ["echo one\n", "cat > f <<EOT\n[x]\nEOT\n"]
        );
        let all = blocks_under(DOC, "First").unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all[1].info, "toml");
        assert_eq!(shell_blocks(DOC, "Nested").unwrap().len(), 1);
    }

    #[test]
    fn a_hash_line_inside_a_block_is_not_a_heading() {
        assert_eq!(shell_blocks(DOC, "Second").unwrap(), ["echo two\n"]);
        assert_eq!(blocks_under(DOC, "Second").unwrap().len(), 2);
    }

    #[test]
    fn a_missing_heading_or_an_open_fence_is_an_error() {
        assert_eq!(
            shell_blocks(DOC, "Third"),
            Err(DocsError::NoHeading("Third".into()))
        );
        assert_eq!(
            shell_blocks("## A\n```sh\necho\n", "A"),
            Err(DocsError::Unclosed("A".into()))
        );
    }
}
