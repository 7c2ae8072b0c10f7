//! How a checkpoint's columns are encoded on the device and on the wire
//! (section 4.2 of the smart-storage paper checkpoints every primitive's
//! output; this is what makes that cheap enough to leave on).
//!
//! A checkpoint is encoded once by the node that owns it, and the same
//! bytes go to its own device and to its mirror or parity node. Two
//! lightweight encodings are offered, alone or together:
//!
//! - **Narrowing** (frame of reference): an integer-backed column (integers,
//!   decimals, dates, timestamps) is stored as its distance from the
//!   column's minimum, in the narrowest unsigned type that holds the range
//!   (`UInt8`, `UInt16` or `UInt32`). Q1's Scan output, four `Decimal64`
//!   columns of 8 bytes, narrows to 2 + 4 + 1 + 1 bytes a row. It costs one
//!   pass to find the range and one to subtract, at memory speed.
//! - **Arrow IPC buffer compression** (LZ4 frame or ZSTD), over the
//!   narrowed columns: more CPU for fewer bytes, which pays on a slow link.
//!
//! ## Format of a narrowed column
//!
//! A column segment (see [`crate::columnar`]) whose field's type differs
//! from the object's schema segment carries in its field metadata:
//!
//! ```text
//! key                       value
//! rebound.narrow.min        the column's minimum, decimal i64 text
//! ```
//!
//! and its values are `UInt8`, `UInt16` or `UInt32` distances from that
//! minimum (nulls stay nulls). Decoding adds the minimum back and
//! reinterprets the integers as the schema's type: bit-exact, and, like
//! every encoding here, deterministic (the same batches give the same
//! bytes), which parity needs.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, PrimitiveArray, make_array};
use arrow::buffer::ScalarBuffer;
use arrow::datatypes::{
    ArrowNativeType, ArrowPrimitiveType, DataType, Field, FieldRef, Int32Type, Int64Type,
    UInt8Type, UInt16Type, UInt32Type,
};
use arrow::error::ArrowError;
use arrow::ipc::CompressionType;
use serde::{Deserialize, Serialize};

/// Field metadata key holding a narrowed column's minimum.
pub const NARROW_MIN: &str = "rebound.narrow.min";

/// A checkpoint encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Codec {
    /// Arrow IPC as the columns are in memory.
    Plain,
    /// Integer-backed columns narrowed to their range (the default).
    #[default]
    Narrow,
    /// Narrowed, then every buffer LZ4-frame compressed.
    Lz4,
    /// Narrowed, then every buffer ZSTD compressed.
    Zstd,
}

impl Codec {
    /// Every codec, in the order reports list them.
    pub const ALL: [Codec; 4] = [Codec::Plain, Codec::Narrow, Codec::Lz4, Codec::Zstd];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Plain => "plain",
            Codec::Narrow => "narrow",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }

    /// Whether integer-backed columns are narrowed.
    pub fn narrows(self) -> bool {
        self != Codec::Plain
    }

    /// The IPC buffer compression it applies.
    pub fn compression(self) -> Option<CompressionType> {
        match self {
            Codec::Plain | Codec::Narrow => None,
            Codec::Lz4 => Some(CompressionType::LZ4_FRAME),
            Codec::Zstd => Some(CompressionType::ZSTD),
        }
    }
}

impl std::str::FromStr for Codec {
    type Err = String;
    fn from_str(s: &str) -> Result<Codec, String> {
        Codec::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| format!("unknown checkpoint codec {s:?} (plain, narrow, lz4, zstd)"))
    }
}

/// The signed integer type an integer-backed type is stored as, and its
/// width in bytes; `None` for types narrowing leaves alone.
fn physical(t: &DataType) -> Option<(DataType, usize)> {
    Some(match t {
        DataType::Int32 | DataType::Date32 | DataType::Decimal32(_, _) => (DataType::Int32, 4),
        DataType::Int64
        | DataType::Date64
        | DataType::Decimal64(_, _)
        | DataType::Timestamp(_, _) => (DataType::Int64, 8),
        _ => return None,
    })
}

/// `a`'s buffers seen as type `to` (same layout, no copy).
fn reinterpret(a: &dyn Array, to: &DataType) -> Result<ArrayRef, ArrowError> {
    let data = a.to_data().into_builder().data_type(to.clone()).build()?;
    Ok(make_array(data))
}

/// The narrow type for a range of `span` (max - min), if narrower than
/// `width` bytes.
fn narrow_type(span: u64, width: usize) -> Option<DataType> {
    let (t, w) = if span <= u8::MAX as u64 {
        (DataType::UInt8, 1)
    } else if span <= u16::MAX as u64 {
        (DataType::UInt16, 2)
    } else if span <= u32::MAX as u64 {
        (DataType::UInt32, 4)
    } else {
        return None;
    };
    (w < width).then_some(t)
}

/// The distances of `a`'s values from `lo` as `N`, in one pass; nulls
/// kept. The caller checked that every valid value's distance fits.
fn pack<P, N>(a: &PrimitiveArray<P>, lo: i64) -> ArrayRef
where
    P: ArrowPrimitiveType,
    P::Native: Into<i64>,
    N: ArrowPrimitiveType,
{
    // `usize_as` keeps the low bits, which hold the whole distance; values
    // under a null are arbitrary and truncated like the rest.
    let values: ScalarBuffer<N::Native> = a
        .values()
        .iter()
        .map(|&v| N::Native::usize_as(v.into().wrapping_sub(lo) as usize))
        .collect();
    Arc::new(PrimitiveArray::<N>::new(values, a.nulls().cloned()))
}

/// The smallest and largest of `a`'s valid values; `None` when it has
/// none. One pass over the values when there are no nulls.
fn range_of<P>(a: &PrimitiveArray<P>) -> Option<(i64, i64)>
where
    P: ArrowPrimitiveType,
    P::Native: Into<i64> + arrow::datatypes::ArrowNativeTypeOp,
{
    if a.null_count() > 0 {
        let (lo, hi) = (arrow::compute::min(a)?, arrow::compute::max(a)?);
        return Some((lo.into(), hi.into()));
    }
    let values = a.values();
    if values.is_empty() {
        return None;
    }
    Some(values.iter().fold((i64::MAX, i64::MIN), |(lo, hi), &v| {
        let v: i64 = v.into();
        (lo.min(v), hi.max(v))
    }))
}

/// Narrows the blocks of one physical type `P`.
fn narrow_blocks<P>(blocks: &[ArrayRef], width: usize) -> Option<(DataType, i64, Vec<ArrayRef>)>
where
    P: ArrowPrimitiveType,
    P::Native: Into<i64> + arrow::datatypes::ArrowNativeTypeOp,
{
    let typed: Vec<&PrimitiveArray<P>> = blocks.iter().map(|b| b.as_primitive::<P>()).collect();
    let mut range: Option<(i64, i64)> = None;
    for b in &typed {
        if let Some((lo, hi)) = range_of(b) {
            range = Some(range.map_or((lo, hi), |(a, z)| (a.min(lo), z.max(hi))));
        }
    }
    // All null (or no rows): nothing to gain.
    let (lo, hi) = range?;
    let to = narrow_type(hi.wrapping_sub(lo) as u64, width)?;
    let out = typed
        .iter()
        .map(|a| match to {
            DataType::UInt8 => pack::<P, UInt8Type>(a, lo),
            DataType::UInt16 => pack::<P, UInt16Type>(a, lo),
            _ => pack::<P, UInt32Type>(a, lo),
        })
        .collect();
    Some((to, lo, out))
}

/// Narrows one column (all its row blocks): the field it is stored under
/// and the narrowed blocks, or `None` when narrowing does not shrink it.
pub fn narrow(
    field: &FieldRef,
    blocks: &[ArrayRef],
) -> Result<Option<(FieldRef, Vec<ArrayRef>)>, ArrowError> {
    let Some((phys, width)) = physical(field.data_type()) else {
        return Ok(None);
    };
    let seen: Vec<ArrayRef> = blocks
        .iter()
        .map(|b| reinterpret(b.as_ref(), &phys))
        .collect::<Result<_, _>>()?;
    let narrowed = match phys {
        DataType::Int32 => narrow_blocks::<Int32Type>(&seen, width),
        _ => narrow_blocks::<Int64Type>(&seen, width),
    };
    let Some((to, lo, out)) = narrowed else {
        return Ok(None);
    };
    let mut meta: HashMap<String, String> = field.metadata().clone();
    meta.insert(NARROW_MIN.into(), lo.to_string());
    let f = Field::new(field.name(), to, field.is_nullable()).with_metadata(meta);
    Ok(Some((Arc::new(f), out)))
}

/// `min` plus each of `a`'s distances, as physical type `P`, in one pass;
/// an error if a valid value does not fit `P`.
fn unpack<N, P>(a: &PrimitiveArray<N>, min: i64) -> Result<ArrayRef, String>
where
    N: ArrowPrimitiveType,
    N::Native: Into<u64>,
    P: ArrowPrimitiveType,
    P::Native: TryFrom<i64> + Default,
{
    if let Some(hi) = arrow::compute::max(a) {
        let top = min.checked_add_unsigned(hi.into());
        if top.is_none_or(|t| P::Native::try_from(t).is_err()) || P::Native::try_from(min).is_err()
        {
            return Err(format!(
                "narrowed values from {min} up {} overflow {}",
                hi.into(),
                P::DATA_TYPE
            ));
        }
    }
    let values: ScalarBuffer<P::Native> = a
        .values()
        .iter()
        .map(|&d| P::Native::try_from(min.wrapping_add_unsigned(d.into())).unwrap_or_default())
        .collect();
    Ok(Arc::new(PrimitiveArray::<P>::new(
        values,
        a.nulls().cloned(),
    )))
}

/// Widens a column segment stored under `stored` back to `want`'s type.
/// A column stored as `want` is returned as it is.
pub fn widen(want: &Field, stored: &Field, a: ArrayRef) -> Result<ArrayRef, String> {
    if stored.data_type() == want.data_type() {
        return Ok(a);
    }
    let min: i64 = stored
        .metadata()
        .get(NARROW_MIN)
        .ok_or_else(|| {
            format!(
                "column {} is stored as {} where the schema says {}, without {NARROW_MIN}",
                want.name(),
                stored.data_type(),
                want.data_type()
            )
        })?
        .parse()
        .map_err(|e| format!("column {}: bad {NARROW_MIN}: {e}", want.name()))?;
    let Some((phys, _)) = physical(want.data_type()) else {
        return Err(format!(
            "column {} of type {} cannot have been narrowed",
            want.name(),
            want.data_type()
        ));
    };
    let wide = |r: Result<ArrayRef, String>| r.map_err(|e| format!("column {}: {e}", want.name()));
    let out = match (stored.data_type(), &phys) {
        (DataType::UInt8, DataType::Int32) => {
            wide(unpack::<UInt8Type, Int32Type>(a.as_primitive(), min))?
        }
        (DataType::UInt16, DataType::Int32) => {
            wide(unpack::<UInt16Type, Int32Type>(a.as_primitive(), min))?
        }
        (DataType::UInt8, _) => wide(unpack::<UInt8Type, Int64Type>(a.as_primitive(), min))?,
        (DataType::UInt16, _) => wide(unpack::<UInt16Type, Int64Type>(a.as_primitive(), min))?,
        (DataType::UInt32, DataType::Int64) => {
            wide(unpack::<UInt32Type, Int64Type>(a.as_primitive(), min))?
        }
        (t, _) => {
            return Err(format!(
                "column {} narrowed to {t}, which is not a narrow type for {}",
                want.name(),
                want.data_type()
            ));
        }
    };
    reinterpret(out.as_ref(), want.data_type()).map_err(|e| format!("column {}: {e}", want.name()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Date32Array, Decimal64Array, Int32Array, StringArray};

    fn roundtrip(field: Field, blocks: Vec<ArrayRef>) -> Option<DataType> {
        let field = Arc::new(field);
        match narrow(&field, &blocks).unwrap() {
            None => None,
            Some((stored, narrowed)) => {
                for (n, b) in narrowed.iter().zip(&blocks) {
                    let back = widen(&field, &stored, n.clone()).unwrap();
                    assert_eq!(back.to_data(), b.to_data());
                }
                Some(stored.data_type().clone())
            }
        }
    }

    #[test]
    fn decimals_narrow_to_the_smallest_type_holding_their_range_and_widen_bit_exact() {
        let d = |v: Vec<Option<i64>>| -> ArrayRef {
            Arc::new(
                Decimal64Array::from(v)
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
            )
        };
        let f = Field::new("q", DataType::Decimal64(15, 2), true);
        // Quantities 1.00 to 50.00, with a null: 16 bits.
        let got = roundtrip(
            f.clone(),
            vec![d(vec![Some(100), None, Some(5000)]), d(vec![Some(2500)])],
        );
        assert_eq!(got, Some(DataType::UInt16));
        // A negative minimum and a range of 255: 8 bits.
        let got = roundtrip(f.clone(), vec![d(vec![Some(-200), Some(55)])]);
        assert_eq!(got, Some(DataType::UInt8));
        // A range past 32 bits is left wide.
        let got = roundtrip(f, vec![d(vec![Some(i64::MIN), Some(i64::MAX)])]);
        assert_eq!(got, None);
    }

    #[test]
    fn dates_and_ints_narrow_and_other_types_are_left_alone() {
        let dates: ArrayRef = Arc::new(Date32Array::from(vec![Some(9000), None, Some(10500)]));
        let got = roundtrip(Field::new("d", DataType::Date32, false), vec![dates]);
        assert_eq!(got, Some(DataType::UInt16));
        let ints: ArrayRef = Arc::new(Int32Array::from(vec![70_000, 1]));
        let got = roundtrip(Field::new("i", DataType::Int32, false), vec![ints]);
        assert_eq!(got, None, "a 17-bit range in 4 bytes does not shrink to 2");
        let s: ArrayRef = Arc::new(StringArray::from(vec!["a"]));
        assert_eq!(
            roundtrip(Field::new("s", DataType::Utf8, false), vec![s]),
            None
        );
    }

    #[test]
    fn a_narrowed_column_without_its_minimum_or_out_of_range_is_refused() {
        let want = Field::new("q", DataType::Int64, false);
        let stored = Field::new("q", DataType::UInt8, false);
        let a: ArrayRef = Arc::new(arrow::array::UInt8Array::from(vec![1u8]));
        let e = widen(&want, &stored, a.clone()).unwrap_err();
        assert!(e.contains(NARROW_MIN), "{e}");
        let bad = stored
            .clone()
            .with_metadata(HashMap::from([(NARROW_MIN.to_string(), "x".to_string())]));
        assert!(widen(&want, &bad, a.clone()).is_err());
        let small = Field::new("q", DataType::Int32, false);
        let meta = HashMap::from([(NARROW_MIN.to_string(), i32::MAX.to_string())]);
        let e = widen(&small, &stored.with_metadata(meta), a).unwrap_err();
        assert!(e.contains("q"), "{e}");
    }

    #[test]
    fn codec_names_parse_back() {
        for c in Codec::ALL {
            assert_eq!(c.name().parse::<Codec>().unwrap(), c);
        }
        assert!("gzip".parse::<Codec>().unwrap_err().contains("gzip"));
    }
}
