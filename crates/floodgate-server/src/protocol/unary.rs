//! One unary gRPC method served by hand (the RLS and budget services), with
//! a prost codec whose buffers fit the messages.
//!
//! tonic's default codec gives every call an 8 KiB decode buffer and an
//! 8 KiB encode buffer: past the allocator's thread cache, so each call
//! paid two trips through `malloc`'s slow path and `free`'s consolidation
//! (a fifth of the server's CPU on reserve-and-settle). A decision's
//! request and answer are a few hundred bytes: the buffers start at
//! [`BUFFER`] and grow when a message needs more.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use http_body::Body;
use tonic::codec::{BufferSettings, Codec};
use tonic::{Response, Status};
use tonic_prost::ProstCodec;

/// Where each call's buffers start (they grow for a larger message).
pub const BUFFER: usize = 1024;

/// The boxed future of a method.
pub type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

/// A box of a server's error.
pub type StdError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// [`ProstCodec`] with buffers of [`BUFFER`] bytes.
#[derive(Debug)]
pub struct SmallCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = <ProstCodec<T, U> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}

fn settings() -> BufferSettings {
    // tonic's yield threshold (32 KiB) kept.
    BufferSettings::new(BUFFER, 32 * 1024)
}

/// A method: its server and the function answering a request.
struct Method<T, F>(T, F);

impl<T, Req, Resp, F, Fut> tonic::server::UnaryService<Req> for Method<T, F>
where
    T: Clone,
    F: Fn(T, Req) -> Fut + Clone,
    Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
{
    type Response = Resp;
    type Future = BoxFuture<Response<Resp>, Status>;

    fn call(&mut self, request: tonic::Request<Req>) -> Self::Future {
        let fut = (self.1)(self.0.clone(), request.into_inner());
        Box::pin(async move { fut.await.map(Response::new) })
    }
}

/// Serve `req` as one unary call of `f` on `server`, messages at most
/// `max_message` bytes.
pub async fn unary<T, Req, Resp, F, Fut, B>(
    server: T,
    f: F,
    req: http::Request<B>,
    max_message: usize,
) -> http::Response<tonic::body::Body>
where
    T: Clone + Send + 'static,
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: Fn(T, Req) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let mut grpc = tonic::server::Grpc::new(SmallCodec::<Resp, Req>::default())
        .apply_max_message_size_config(Some(max_message), None);
    grpc.unary(Method(server, f), req).await
}
