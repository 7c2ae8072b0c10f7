//! Plain-text output helpers shared by `rebound`'s own commands (`rebound
//! box inspect`) and the experiments' reports: an aligned table and
//! thousands separators. No dependencies, so the server-only build keeps
//! them.

/// A text table: a header row and data rows, columns right-aligned except
/// the first.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|s| (*s).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Append a row (as many cells as the header).
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.header.len());
        self.rows.push(cells);
    }

    /// Render with aligned columns.
    pub fn render(&self) -> String {
        let cols = self.header.len();
        let width: Vec<usize> = (0..cols)
            .map(|c| {
                std::iter::once(&self.header[c])
                    .chain(self.rows.iter().map(|r| &r[c]))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| -> String {
            cells
                .iter()
                .enumerate()
                .map(|(c, s)| {
                    if c == 0 {
                        format!("{s:<w$}", w = width[c])
                    } else {
                        format!("{s:>w$}", w = width[c])
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * (cols - 1)));
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out
    }
}

/// Thousands separators for a count.
pub fn thousands(n: f64) -> String {
    let s = format!("{:.0}", n.max(0.0));
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{Table, thousands};

    #[test]
    fn columns_align_the_first_left_and_the_rest_right() {
        let mut t = Table::new(&["name", "n"]);
        t.row(vec!["a".into(), "1,000".into()]);
        t.row(vec!["longer".into(), "7".into()]);
        assert_eq!(
            t.render(),
            "name        n\n-------------\na       1,000\nlonger      7"
        );
    }

    #[test]
    fn thousands_groups_digits_and_rounds() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
        assert_eq!(thousands(-5.0), "0");
    }
}
