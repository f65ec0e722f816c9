//! The codec of every `dispatch.v1` client and server: prost's
//! (`application/grpc+proto`, the same bytes on the wire), with smaller
//! first buffers.
//!
//! tonic gives each call, and each direction of a stream, a buffer of its
//! codec's `buffer_size` up front (8 KiB by default) and keeps it for the
//! call's life. An agent's Attach stream lives as long as the agent, so
//! with the default a dispatcher held 16 KiB of codec buffers per node
//! whatever the agent said. Our messages are small (a LoadReport of 64
//! CPUs is about 1.5 KiB, an Assign under 1 KiB), so the buffers start at
//! [`FIRST_BUFFER_BYTES`] and grow (as `BytesMut` does: to the size
//! needed, at least doubling) to the largest message a stream has
//! carried, which they keep. A buffer sized for the usual message would
//! only be held idle by the streams that never carry one: the
//! dispatcher's side of an Attach stream sends a Registered and then,
//! while its node runs nothing, no more (1 KiB first buffers held
//! 1,024 + 208 bytes per idle agent for it). The yield threshold (how
//! much a stream batches into one write) keeps tonic's default.
//!
//! Its encoder writes a message with `Message::encode_raw`: prost's
//! `Message::encode` first computes the message's encoded length (each
//! nested message's, recursively) only to check it against the room
//! left, which tonic's buffer, growing as it is written, always has. An
//! `Assign` is nested two deep (the stream's `DispatcherMessage`, then
//! its spec), so that check was a third pass of its spec's lengths
//! (its environment map's entries), on the gRPC workers, for every start.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic_prost::{ProstCodec, ProstDecoder};

/// The first size of each call's encode and decode buffers, bytes.
pub const FIRST_BUFFER_BYTES: usize = 128;

/// tonic's default yield threshold (32 KiB), kept.
const YIELD_THRESHOLD: usize = 32 * 1024;

fn settings() -> BufferSettings {
    BufferSettings::new(FIRST_BUFFER_BYTES, YIELD_THRESHOLD)
}

/// prost's codec with [`FIRST_BUFFER_BYTES`] buffers (the generated
/// clients and servers use it: `codec_path` in `build.rs`).
#[derive(Debug, Clone, Copy)]
pub struct SmallBuffers<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBuffers<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallBuffers<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = RawEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}

/// prost's encoding of `T` without `Message::encode`'s length check
/// (see the module's doc), with [`FIRST_BUFFER_BYTES`] buffers.
#[derive(Debug, Clone, Copy)]
pub struct RawEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for RawEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // The buffer grows as it is written (`BytesMut`): there is always
        // room, which is all `Message::encode` would check first.
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::LoadReport;

    /// The generated code names this codec, and it starts small.
    #[test]
    fn generated_services_use_the_small_buffers() {
        let generated = include_str!(concat!(env!("OUT_DIR"), "/dispatch.v1.rs"));
        assert!(generated.contains("crate::codec::SmallBuffers::default()"));
        assert!(!generated.contains("ProstCodec::default()"));
        let mut codec = SmallBuffers::<LoadReport, LoadReport>::default();
        let s = codec.encoder().buffer_settings();
        let d = tonic::codec::Decoder::buffer_settings(&codec.decoder());
        for b in [s, d] {
            let shown = format!("{b:?}");
            assert!(
                shown.contains(&format!("buffer_size: {FIRST_BUFFER_BYTES},")),
                "{shown}"
            );
            assert!(shown.contains("yield_threshold: 32768"), "{shown}");
        }
    }
}
