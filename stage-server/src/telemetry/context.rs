//! W3C trace context (`traceparent`): parsed from HTTP headers, formatted back, and packed into the 25 bytes
//! the wire's `Configure` frame carries, so every stage's spans for one request join one trace.

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// A trace id, the id of the span that is the parent, and the flags: what crosses a process boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// 16 bytes, not all zero.
    pub trace_id: [u8; 16],
    /// 8 bytes, not all zero.
    pub span_id: [u8; 8],
    /// Bit 0: sampled.
    pub flags: u8,
}

impl TraceContext {
    /// Parses a `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`); `None` for anything else, including
    /// the all-zero ids the spec forbids and version `ff`. Later versions are read as version 00 (the spec
    /// asks for that) when they have at least its fields.
    pub fn parse_traceparent(header: &str) -> Option<TraceContext> {
        let header = header.trim();
        let mut parts = header.split('-');
        let version = parts.next()?;
        let (trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version.eq_ignore_ascii_case("ff") {
            return None;
        }
        let version = u8::from_str_radix(version, 16).ok()?;
        if version == 0 && parts.next().is_some() {
            return None;
        }
        let mut context = TraceContext {
            trace_id: [0; 16],
            span_id: [0; 8],
            flags: 0,
        };
        hex_into(trace, &mut context.trace_id)?;
        hex_into(span, &mut context.span_id)?;
        let mut flag = [0u8; 1];
        hex_into(flags, &mut flag)?;
        context.flags = flag[0];
        context.is_valid().then_some(context)
    }

    /// The `traceparent` header value (version 00).
    pub fn to_traceparent(&self) -> String {
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        push_hex(&mut out, &self.trace_id);
        out.push('-');
        push_hex(&mut out, &self.span_id);
        out.push('-');
        push_hex(&mut out, &[self.flags]);
        out
    }

    /// The 25 bytes of the wire: trace id, span id, flags.
    pub fn to_wire(&self) -> [u8; 25] {
        let mut bytes = [0u8; 25];
        bytes[..16].copy_from_slice(&self.trace_id);
        bytes[16..24].copy_from_slice(&self.span_id);
        bytes[24] = self.flags;
        bytes
    }

    /// Reads the wire's 25 bytes; `None` when an id is all zero.
    pub fn from_wire(bytes: &[u8; 25]) -> Option<TraceContext> {
        let mut context = TraceContext {
            trace_id: [0; 16],
            span_id: [0; 8],
            flags: bytes[24],
        };
        context.trace_id.copy_from_slice(&bytes[..16]);
        context.span_id.copy_from_slice(&bytes[16..24]);
        context.is_valid().then_some(context)
    }

    /// Whether both ids are non-zero.
    pub fn is_valid(&self) -> bool {
        self.trace_id != [0; 16] && self.span_id != [0; 8]
    }

    /// The OpenTelemetry span context of a remote parent.
    pub fn to_span_context(&self) -> SpanContext {
        SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            TraceFlags::new(self.flags),
            true,
            TraceState::default(),
        )
    }

    /// From an OpenTelemetry span context; `None` when it is invalid (no exporter is installed).
    pub fn from_span_context(context: &SpanContext) -> Option<TraceContext> {
        if !context.is_valid() {
            return None;
        }
        Some(TraceContext {
            trace_id: context.trace_id().to_bytes(),
            span_id: context.span_id().to_bytes(),
            flags: context.trace_flags().to_u8(),
        })
    }

    /// The trace id as 32 hex digits (for logs).
    pub fn trace_id_hex(&self) -> String {
        let mut out = String::with_capacity(32);
        push_hex(&mut out, &self.trace_id);
        out
    }
}

fn hex_into(text: &str, out: &mut [u8]) -> Option<()> {
    if text.len() != out.len() * 2 || !text.is_ascii() {
        return None;
    }
    for (index, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16).ok()?;
    }
    Some(())
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)] as char);
        out.push(DIGITS[usize::from(byte & 15)] as char);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_survives_the_wire_and_formats_back_to_itself() {
        let context = TraceContext::parse_traceparent(EXAMPLE).expect("the spec's example parses");
        assert_eq!(context.flags, 1);
        assert_eq!(context.to_traceparent(), EXAMPLE);
        let wire = context.to_wire();
        assert_eq!(TraceContext::from_wire(&wire), Some(context));
        let span = context.to_span_context();
        assert_eq!(TraceContext::from_span_context(&span), Some(context));
    }

    #[test]
    fn malformed_or_zero_traceparents_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-é1",
        ] {
            assert_eq!(
                TraceContext::parse_traceparent(bad),
                None,
                "{bad:?} should be refused"
            );
        }
        assert_eq!(TraceContext::from_wire(&[0; 25]), None);
    }
}
