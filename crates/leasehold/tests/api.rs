//! What a user of the library meets first: the names it takes, what a guard prints, what
//! it logs. On the in-process store.

use leasehold::{Leasehold, LockName, MemoryStore, Released};

#[tokio::test]
async fn every_method_that_takes_a_name_takes_str_string_and_lock_name_owned_or_borrowed() {
    let locks = Leasehold::new(MemoryStore::new());
    let text = String::from("tenant:42:migrate");
    let name = LockName::new(text.as_str()).unwrap();
    for lock in [
        locks.mutex("tenant:42:migrate").unwrap(),
        locks.mutex(&text).unwrap(),
        locks.mutex(text.clone()).unwrap(),
        locks.mutex(&name).unwrap(),
        locks.mutex(name.clone()).unwrap(),
        locks.mutex(std::borrow::Cow::Borrowed(text.as_str())).unwrap(),
        locks.write(&text).unwrap(),
        locks.write(name.clone()).unwrap(),
        locks.read(&name).unwrap(),
        locks.read(text.clone()).unwrap(),
    ] {
        assert_eq!(lock.name(), &name);
    }
    assert_eq!(locks.semaphore(&text, 2).unwrap().name(), &name);
    assert_eq!(locks.semaphore(name.clone(), 2).unwrap().name(), &name);
    let held = locks.mutex(&name).unwrap().try_lock().await.unwrap().unwrap();
    assert_eq!(locks.describe(&text).await.unwrap().holders.len(), 1);
    assert_eq!(locks.describe(name.clone()).await.unwrap().holders.len(), 1);
    assert!(locks.force_release(&name).await.unwrap());
    assert!(!locks.force_release(text).await.unwrap());
    assert_eq!(held.release().await.unwrap(), Released::NotHeld);
    // A name that breaks a rule is refused whatever it comes as.
    assert!(locks.mutex(String::new()).is_err());
    let control = "a\nb".to_string();
    assert!(locks.mutex(&control).is_err());
}

#[tokio::test]
async fn mutex_and_write_of_one_name_are_the_same_lock() {
    let locks = Leasehold::new(MemoryStore::new());
    let mutex = locks.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    assert!(locks.write("k").unwrap().try_lock().await.unwrap().is_none());
    assert!(locks.read("k").unwrap().try_lock().await.unwrap().is_none());
    let _ = mutex.release().await.unwrap();
    let writer = locks.write("k").unwrap().try_lock().await.unwrap().unwrap();
    assert!(locks.mutex("k").unwrap().try_lock().await.unwrap().is_none());
    let _ = writer.release().await.unwrap();
}
