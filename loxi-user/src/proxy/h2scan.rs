//! Where a client's HTTP/2 header blocks begin and end in its byte stream, found from the frame
//! headers alone (RFC 9113 §4.1: a 9-byte header of a 24-bit length, a type, flags and a
//! stream id; nothing is decoded). The connection watchdog (`conn.rs`) uses it to time a
//! request head over HTTP/2 as nginx's `client_header_timeout` does: from a HEADERS frame to
//! the end of the frame that carries END_HEADERS (RFC 9113 §6.2, §6.10). The other frames a
//! client sends on an idle connection (WINDOW_UPDATE for an answer it read, PING, SETTINGS)
//! are traffic, not the start of a head.

/// The client connection preface (RFC 9113 §3.4), which opens every HTTP/2 connection, with
/// prior knowledge or after TLS's ALPN `h2`.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const FRAME_HEADER: usize = 9;

/// The frame scanner of one HTTP/2 client stream (after its preface).
#[derive(Debug, Default)]
pub struct Scan {
    /// The frame header being read, and how much of it arrived.
    header: [u8; FRAME_HEADER],
    header_len: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: u32,
    /// The current frame is part of a header block (HEADERS, or CONTINUATION of an open one).
    in_block: bool,
    /// The current frame ends its header block (END_HEADERS).
    ends_block: bool,
    /// A header block has begun and not ended.
    block_open: bool,
}

/// What one read of the client's bytes held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fed {
    /// Bytes of header-block frames (their 9-byte headers and payloads).
    pub head_bytes: u64,
    /// A header block is still open after these bytes (its END_HEADERS frame has not fully
    /// arrived).
    pub head_open: bool,
}

impl Scan {
    /// Follows the frames through `bytes`, the next bytes the client sent. A frame or a frame
    /// header may end anywhere; the state carries over to the next call.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Fed {
        let mut head = 0u64;
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let k = bytes.len().min(self.payload_left as usize);
                if self.in_block {
                    head += k as u64;
                }
                self.payload_left -= k as u32;
                bytes = &bytes[k..];
                if self.payload_left == 0 {
                    self.frame_done();
                }
                continue;
            }
            let k = bytes.len().min(FRAME_HEADER - self.header_len);
            self.header[self.header_len..self.header_len + k].copy_from_slice(&bytes[..k]);
            self.header_len += k;
            bytes = &bytes[k..];
            if self.header_len < FRAME_HEADER {
                break;
            }
            self.header_len = 0;
            let [l0, l1, l2, kind, flags, ..] = self.header;
            self.in_block = kind == HEADERS || (kind == CONTINUATION && self.block_open);
            if self.in_block {
                head += FRAME_HEADER as u64;
                self.block_open = true;
                self.ends_block = flags & END_HEADERS != 0;
            }
            self.payload_left = u32::from_be_bytes([0, l0, l1, l2]);
            if self.payload_left == 0 {
                self.frame_done();
            }
        }
        Fed {
            head_bytes: head,
            head_open: self.block_open,
        }
    }

    fn frame_done(&mut self) {
        if self.ends_block {
            self.block_open = false;
        }
        self.in_block = false;
        self.ends_block = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn only_header_blocks_count_and_a_block_ends_with_end_headers() {
        let mut s = Scan::default();
        // SETTINGS, WINDOW_UPDATE and PING: traffic, no head.
        let mut b = frame(0x4, 0, &[]);
        b.extend(frame(0x8, 0, &[0, 0, 1, 0]));
        b.extend(frame(0x6, 0, &[0; 8]));
        assert_eq!(
            s.feed(&b),
            Fed {
                head_bytes: 0,
                head_open: false
            }
        );
        // HEADERS without END_HEADERS, then a DATA frame of another stream (not a CONTINUATION:
        // not part of the block), then the CONTINUATION that ends it.
        let h = frame(HEADERS, 0, &[0xaa; 20]);
        assert_eq!(
            s.feed(&h),
            Fed {
                head_bytes: 29,
                head_open: true
            }
        );
        assert_eq!(s.feed(&frame(0x0, 0, &[1; 5])).head_bytes, 0);
        assert_eq!(
            s.feed(&frame(CONTINUATION, END_HEADERS, &[0xbb; 7])),
            Fed {
                head_bytes: 16,
                head_open: false
            }
        );
        // A CONTINUATION with no open block is not a head.
        assert_eq!(
            s.feed(&frame(CONTINUATION, END_HEADERS, &[1; 3]))
                .head_bytes,
            0
        );
    }

    #[test]
    fn frames_split_anywhere_across_reads_are_followed() {
        let mut bytes = frame(0x8, 0, &[0, 0, 1, 0]);
        bytes.extend(frame(HEADERS, END_HEADERS, &[0xaa; 30]));
        bytes.extend(frame(0x6, 0, &[0; 8]));
        // One byte at a time: the block opens at the HEADERS frame's 9th header byte and ends
        // with its last payload byte.
        let mut s = Scan::default();
        let mut open_at = Vec::new();
        let mut head = 0;
        for (i, b) in bytes.iter().enumerate() {
            let fed = s.feed(std::slice::from_ref(b));
            head += fed.head_bytes;
            if fed.head_open {
                open_at.push(i);
            }
        }
        assert_eq!(head, 39);
        // WINDOW_UPDATE is 13 bytes; HEADERS' header ends at byte 21, its payload at 51.
        assert_eq!(open_at.first(), Some(&21));
        assert_eq!(open_at.last(), Some(&50));
        assert_eq!(open_at.len(), 30);
        // All at once: the same count, the block closed.
        assert_eq!(
            Scan::default().feed(&bytes),
            Fed {
                head_bytes: 39,
                head_open: false
            }
        );
    }
}
