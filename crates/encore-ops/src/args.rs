//! Typed argument layouts: one type per op says which buffers the op binds,
//! in which order, with which access, and the value that follows them.
//!
//! [`op_args!`](crate::op_args) declares such a type once; the same type then
//! serves everything that handles the op's arguments:
//!
//! - [`crate::Ops`] builds it from the caller's buffers and dispatches
//!   [`args`](crate::kernels::norm::NormArgs::args), so every buffer is bound with its declared
//!   access over the exact range the kernel touches;
//! - the CPU bodies ([`crate::cpu`]) take it apart with `from_cpu`, getting
//!   each buffer by name as a slice;
//! - the fusion rules ([`crate::fusion`]) read recorded graph nodes with
//!   `from_node` and build fused ones with `into_node`.
//!
//! Nothing outside the generated code reads an argument by its position.
//!
//! A layout is a list of buffers, each with the expression of its access
//! (evaluated with the value in scope, for ops whose outputs are read too
//! under some values), then one value argument:
//!
//! ```
//! use encore::Access;
//! #[repr(C)]
//! #[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
//! pub struct ScaleShape { pub n: u32, pub factor: f32 }
//! encore_ops::op_args! {
//!     /// `y = x * factor`.
//!     pub struct ScaleArgs { x: Access::Read, y: Access::Write; shape: ScaleShape }
//! }
//! ```

use encore::CpuArgs;

/// One buffer argument of a CPU kernel body, taken out of its layout.
///
/// Borrowing it reads or writes the dispatch's memory; the runtime checks
/// that a written argument was declared written and that no argument is
/// borrowed mutably twice.
#[derive(Clone, Copy)]
pub struct CpuArg<'r, 'a> {
    args: &'r CpuArgs<'a>,
    index: usize,
}

impl<'r, 'a> CpuArg<'r, 'a> {
    #[doc(hidden)]
    pub fn new(args: &'r CpuArgs<'a>, index: usize) -> CpuArg<'r, 'a> {
        CpuArg { args, index }
    }

    /// The buffer as a shared slice of `T`.
    pub fn read<T: bytemuck::Pod>(&self) -> Result<&'a [T], String> {
        self.args.read(self.index)
    }

    /// The buffer as a mutable slice of `T`; it must be declared written.
    pub fn write<T: bytemuck::Pod>(&self) -> Result<&'a mut [T], String> {
        self.args.write(self.index)
    }

    /// The one-element `u32` buffer of a graph parameter (a decode position).
    pub fn param(&self) -> Result<u32, String> {
        self.read::<u32>()?
            .first()
            .copied()
            .ok_or_else(|| "empty parameter slot".to_string())
    }
}

/// Declares an op's argument layout: a struct generic over how a buffer is
/// held (`encore::Buffer` by the op layer and graphs, [`CpuArg`] by CPU
/// bodies), with the buffers in argument order and the value last. See the
/// [module docs](crate::args).
#[macro_export]
macro_rules! op_args {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $($field:ident : $access:expr),+ ;
            $value:ident : $vty:ty $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug)]
        pub struct $name<B = ::encore::Buffer> {
            $(pub $field: B,)+
            pub $value: $vty,
        }

        impl<B> $name<B> {
            /// Each buffer's access under this layout's value, in argument order.
            #[allow(unused_variables)]
            pub fn accesses(&self) -> ::std::vec::Vec<::encore::Access> {
                let $value = &self.$value;
                vec![$($access),+]
            }
        }

        impl $name<::encore::Buffer> {
            /// The dispatch arguments: every buffer with its access, then the value.
            #[allow(unused_variables)]
            pub fn args(&self) -> ::std::vec::Vec<::encore::Arg<'_>> {
                let $value = &self.$value;
                vec![
                    $(::encore::Arg::Buffer(&self.$field, $access),)+
                    ::encore::Arg::value(&self.$value),
                ]
            }

            /// The layout of a recorded graph node, if the node has exactly
            /// this shape of arguments.
            pub fn from_node(node: &::encore::Node) -> ::std::option::Option<Self> {
                let mut args = node.args.iter();
                $(
                    let $field = match args.next()? {
                        ::encore::NodeArg::Buffer(b, _) => b.clone(),
                        ::encore::NodeArg::Bytes(_) => return None,
                    };
                )+
                let $value: $vty = match args.next()? {
                    ::encore::NodeArg::Bytes(bytes) => ::bytemuck::try_pod_read_unaligned(bytes).ok()?,
                    ::encore::NodeArg::Buffer(..) => return None,
                };
                if args.next().is_some() {
                    return None;
                }
                Some($name { $($field,)+ $value })
            }

            /// A graph node dispatching `kernel` over these arguments.
            #[allow(unused_variables)]
            pub fn into_node(self, kernel: &::encore::Kernel, label: impl Into<::encore::Label>) -> ::encore::Node {
                let value: $vty = self.$value;
                let $value = &value;
                let args = vec![
                    $(::encore::NodeArg::Buffer(self.$field, $access),)+
                    ::encore::NodeArg::Bytes(::bytemuck::bytes_of(&value).to_vec()),
                ];
                ::encore::Node { kernel: kernel.clone(), args, label: label.into() }
            }
        }

        impl<'r, 'a> $name<$crate::args::CpuArg<'r, 'a>> {
            /// The layout of a CPU dispatch's arguments.
            pub fn from_cpu(a: &'r ::encore::CpuArgs<'a>) -> ::std::result::Result<Self, ::std::string::String> {
                let mut index = 0usize;
                $(
                    let $field = $crate::args::CpuArg::new(a, index);
                    index += 1;
                )+
                if a.len() != index + 1 {
                    return Err(format!(
                        "{}: {} arguments, expected {}",
                        stringify!($name),
                        a.len(),
                        index + 1
                    ));
                }
                let $value: $vty = a.scalar(index)?;
                Ok($name { $($field,)+ $value })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use encore::{Access, Device, NodeArg};

    use crate::kernels::fused::{FusedArgs, FusedShape, EPILOGUE_ACCUMULATE, EPILOGUE_STORE};
    use crate::kernels::norm::{NormArgs, NormShape};

    #[test]
    fn a_layout_round_trips_through_a_graph_node_and_refuses_other_shapes() -> encore::Result<()> {
        let device = Device::cpu()?;
        let kernel = device.load_kernel(&crate::KernelSet::Default.defs().rms_norm)?;
        let (x, w, y) = (device.alloc(64)?, device.alloc(16)?, device.alloc(64)?);
        let shape = NormShape {
            rows: 4,
            dim: 4,
            eps: 1e-5,
        };
        let args = NormArgs {
            x: x.clone(),
            w: w.clone(),
            y: y.clone(),
            shape,
        };
        let node = args.into_node(&kernel, "norm");
        let accesses: Vec<Access> = node
            .args
            .iter()
            .filter_map(|a| match a {
                NodeArg::Buffer(_, access) => Some(*access),
                NodeArg::Bytes(_) => None,
            })
            .collect();
        assert_eq!(accesses, [Access::Read, Access::Read, Access::Write]);
        let back = NormArgs::from_node(&node).ok_or(encore::Error::Graph("no layout".into()))?;
        assert_eq!(back.y.allocation_id(), y.allocation_id());
        assert_eq!((back.shape.rows, back.shape.dim), (4, 4));
        // One argument short, or a value of another size: not this layout.
        let mut short = node.clone();
        short.args.remove(0);
        assert!(NormArgs::from_node(&short).is_none());
        let mut wrong = node;
        wrong.args.pop();
        wrong.args.push(NodeArg::Bytes(vec![0; 4]));
        assert!(NormArgs::from_node(&wrong).is_none());
        Ok(())
    }

    #[test]
    fn an_access_may_depend_on_the_value() -> encore::Result<()> {
        let device = Device::cpu()?;
        let b = device.alloc(4)?;
        let mut args = FusedArgs {
            x: b.clone(),
            g: b.clone(),
            w0: b.clone(),
            w1: b.clone(),
            w2: b.clone(),
            y0: b.clone(),
            y1: b.clone(),
            y2: b.clone(),
            b0: b.clone(),
            b1: b.clone(),
            b2: b,
            shape: bytemuck::Zeroable::zeroed(),
        };
        let outputs = |a: &FusedArgs| a.accesses()[5..8].to_vec();
        args.shape = FusedShape {
            epilogue: EPILOGUE_STORE,
            ..args.shape
        };
        assert_eq!(outputs(&args), [Access::Write; 3]);
        args.shape.epilogue = EPILOGUE_ACCUMULATE;
        assert_eq!(outputs(&args), [Access::ReadWrite; 3]);
        Ok(())
    }
}
