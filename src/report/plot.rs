//! Line charts as PNG files with no plotting or image dependency: a small
//! raster, a 5x7 pixel font for the labels, and a PNG encoder that stores
//! the image in uncompressed deflate blocks (readable by every viewer).

use std::path::Path;

use crate::error::Result;
use crate::io::write_atomic;

const W: usize = 640;
const H: usize = 360;
const LEFT: usize = 70;
const RIGHT: usize = 20;
const TOP: usize = 36;
const BOTTOM: usize = 40;

struct Canvas {
    px: Vec<[u8; 3]>,
}

impl Canvas {
    fn new() -> Self {
        Self { px: vec![[255, 255, 255]; W * H] }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            self.px[y as usize * W + x as usize] = c;
        }
    }

    /// Bresenham, two pixels thick.
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3]) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.set(x, y, c);
            self.set(x, y + 1, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text in the 5x7 font, scale 2, top-left at (x, y).
    fn text(&mut self, x: i64, y: i64, s: &str, c: [u8; 3]) {
        for (i, ch) in s.chars().enumerate() {
            let rows = glyph(ch);
            for (r, bits) in rows.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        for (ox, oy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                            self.set(x + (i as i64 * 6 + col) * 2 + ox, y + r as i64 * 2 + oy, c);
                        }
                    }
                }
            }
        }
    }
}

/// 5x7 glyphs, one byte per row (low 5 bits). Unknown characters draw blank.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_lowercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '/' => [0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        'a' => [0, 0, 0x0E, 0x01, 0x0F, 0x11, 0x0F],
        'b' => [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E],
        'c' => [0, 0, 0x0E, 0x10, 0x10, 0x11, 0x0E],
        'd' => [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F],
        'e' => [0, 0, 0x0E, 0x11, 0x1F, 0x10, 0x0E],
        'f' => [0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08],
        'g' => [0, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E],
        'h' => [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11],
        'i' => [0x04, 0, 0x0C, 0x04, 0x04, 0x04, 0x0E],
        'j' => [0x02, 0, 0x06, 0x02, 0x02, 0x12, 0x0C],
        'k' => [0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12],
        'l' => [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'm' => [0, 0, 0x1A, 0x15, 0x15, 0x11, 0x11],
        'n' => [0, 0, 0x16, 0x19, 0x11, 0x11, 0x11],
        'o' => [0, 0, 0x0E, 0x11, 0x11, 0x11, 0x0E],
        'p' => [0, 0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10],
        'q' => [0, 0, 0x0D, 0x13, 0x0F, 0x01, 0x01],
        'r' => [0, 0, 0x16, 0x19, 0x10, 0x10, 0x10],
        's' => [0, 0, 0x0E, 0x10, 0x0E, 0x01, 0x1E],
        't' => [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06],
        'u' => [0, 0, 0x11, 0x11, 0x11, 0x13, 0x0D],
        'v' => [0, 0, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'w' => [0, 0, 0x11, 0x11, 0x15, 0x15, 0x0A],
        'x' => [0, 0, 0x11, 0x0A, 0x04, 0x0A, 0x11],
        'y' => [0, 0, 0x11, 0x11, 0x0F, 0x01, 0x0E],
        'z' => [0, 0, 0x1F, 0x02, 0x04, 0x08, 0x1F],
        _ => [0; 7],
    }
}

fn label(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Draws `points` (x, y) as a line chart titled `title` and writes a PNG.
pub fn line_chart(path: &Path, title: &str, x_label: &str, points: &[(f64, f64)]) -> Result<()> {
    let mut c = Canvas::new();
    let pts: Vec<(f64, f64)> = points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (mut y0, mut y1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if pts.is_empty() {
        y0 = 0.0;
        y1 = 1.0;
    }
    if y1 - y0 < 1e-9 {
        y0 -= 0.5;
        y1 += 0.5;
    }
    let pad = 0.05 * (y1 - y0);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let to_px = |(x, y): (f64, f64)| -> (i64, i64) {
        let fx = if x1 > x0 { (x - x0) / (x1 - x0) } else { 0.5 };
        ((LEFT as f64 + fx * pw) as i64, (TOP as f64 + (1.0 - (y - y0) / (y1 - y0)) * ph) as i64)
    };
    let (axis, grid, ink, line) = ([60, 60, 60], [225, 225, 225], [30, 30, 30], [31, 119, 180]);
    for i in 0..=4 {
        let y = y0 + (y1 - y0) * i as f64 / 4.0;
        let (_, py) = to_px((x0, y));
        c.line((LEFT as i64, py), ((W - RIGHT) as i64, py), grid);
        c.text(4, py - 7, &label(y), ink);
    }
    c.line((LEFT as i64, TOP as i64), (LEFT as i64, (H - BOTTOM) as i64), axis);
    c.line((LEFT as i64, (H - BOTTOM) as i64), ((W - RIGHT) as i64, (H - BOTTOM) as i64), axis);
    if !pts.is_empty() {
        for x in [x0, (x0 + x1) / 2.0, x1] {
            let (px, _) = to_px((x, y0));
            c.text(px - 10, (H - BOTTOM + 8) as i64, &label(x), ink);
        }
        for w in pts.windows(2) {
            c.line(to_px(w[0]), to_px(w[1]), line);
        }
    }
    c.text(LEFT as i64, 8, title, ink);
    c.text((W - RIGHT - 12 * x_label.len()) as i64, (H - 16) as i64, x_label, ink);
    write_atomic(path, &encode_png(&c.px))
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let mut body = kind.to_vec();
    body.extend(data);
    out.extend(&body);
    out.extend(crc32(&body).to_be_bytes());
}

/// RGB pixels (W x H) as a PNG, deflate in stored blocks.
fn encode_png(px: &[[u8; 3]]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(H * (1 + 3 * W));
    for row in px.chunks(W) {
        raw.push(0); // filter: none
        raw.extend(row.iter().flatten());
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, block) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        z.extend(len.to_le_bytes());
        z.extend((!len).to_le_bytes());
        z.extend(*block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in &raw {
        a = (a + byte as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend(((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend((W as u32).to_be_bytes());
    ihdr.extend((H as u32).to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit RGB
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_valid_png() {
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("p.png");
        let pts: Vec<(f64, f64)> = (0..20).map(|i| (i as f64, (i as f64 * 0.3).sin())).collect();
        line_chart(&path, "reward by step", "step", &pts).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert_eq!(&bytes[12..16], b"IHDR");
        assert!(bytes.ends_with(&[0xAE, 0x42, 0x60, 0x82]));
    }
}
